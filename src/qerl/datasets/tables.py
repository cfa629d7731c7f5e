"""Kedro's versioned tables and plots, written atomically.

``ParquetTable`` / ``CSVTable`` are kedro-datasets' ``pandas.ParquetDataset`` / ``CSVDataset`` with
one change: a version's file is written to a hidden ``.partial-*`` file beside it, fsynced and
renamed into place, so a kill or a full disk during the write leaves the previous version as the
newest (Kedro only lists versions whose file exists). ``FiguresDataset`` saves a dict of matplotlib
figures as PNGs into one versioned directory, atomically, and loads them back as images (PIL) that
render in Jupyter. Local paths only.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import pandas as pd
from kedro.io.core import AbstractVersionedDataset, DatasetError, Version, get_filepath_str
from kedro_datasets.pandas import CSVDataset, ParquetDataset

from qerl.atomic import atomic_directory, atomic_write


class ParquetTable(ParquetDataset):
    """``pandas.ParquetDataset`` with atomic saves."""

    def save(self, data: pd.DataFrame) -> None:
        final = get_filepath_str(self._get_save_path(), self._protocol)
        atomic_write(final, lambda tmp: data.to_parquet(tmp, **self._save_args))
        self._invalidate_cache()


class CSVTable(CSVDataset):
    """``pandas.CSVDataset`` with atomic saves."""

    def save(self, data: pd.DataFrame) -> None:
        final = get_filepath_str(self._get_save_path(), self._protocol)
        atomic_write(final, lambda tmp: data.to_csv(tmp, **self._save_args))
        self._invalidate_cache()


class FiguresDataset(AbstractVersionedDataset[dict[str, Any], dict[str, Any]]):
    """A dict ``{file name: matplotlib Figure}`` saved as PNGs in ``<filepath>/<version>/<name>/``."""

    def __init__(self, *, filepath: str, version: Version | None = None, save_args: dict[str, Any] | None = None,
                 metadata: dict[str, Any] | None = None) -> None:
        super().__init__(filepath=PurePosixPath(filepath), version=version)
        self._save_args = {"dpi": 110, **(save_args or {})}
        self.metadata = metadata

    def save(self, data: dict[str, Any]) -> None:
        import matplotlib.pyplot as plt

        if not isinstance(data, dict):
            raise DatasetError(f"{self._filepath}: expected a dict of file name -> Figure, got {type(data).__name__}")
        with atomic_directory(Path(self._get_save_path())) as tmp:
            for name, fig in data.items():
                fig.savefig(tmp / name, **self._save_args)
                plt.close(fig)

    def load(self) -> dict[str, Any]:
        from PIL import Image

        folder = Path(self._get_load_path())
        if not folder.is_dir():
            raise DatasetError(f"no plots at {folder}; they are written by `kedro run --pipelines=qerl_train`")
        out = {}
        for f in sorted(folder.glob("*.png")):
            with Image.open(f) as im:
                out[f.name] = im.copy()
        return out

    def _exists(self) -> bool:
        try:
            return Path(self._get_load_path()).is_dir()
        except DatasetError:
            return False

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "version": self._version}
