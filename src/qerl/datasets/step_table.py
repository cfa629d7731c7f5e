"""A versioned Parquet table that a node may decline to write (``SKIPPED``).

The training pipeline is unrolled into one namespace per RL step. When a run resumes from a
checkpoint, the steps already done must not overwrite their tables with empty ones, and their
nodes must still return something: they return :data:`SKIPPED`, which this dataset does not
write (and returns again on load within the same process). Layout and version semantics are
Kedro's: ``<filepath>/<version>/<name>``, newest version loaded unless pinned.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

import pandas as pd
from kedro.io.core import AbstractDataset, DatasetError, Version

SKIPPED = pd.DataFrame({"__skipped__": []})
SKIPPED.attrs["qerl_skipped"] = True


def is_skipped(data: Any) -> bool:
    """True for the :data:`SKIPPED` marker (or any frame flagged like it)."""
    return isinstance(data, pd.DataFrame) and bool(data.attrs.get("qerl_skipped"))


class StepTableDataset(AbstractDataset[pd.DataFrame, pd.DataFrame]):
    """Versioned Parquet file whose ``save(SKIPPED)`` is a no-op.

    Args:
        filepath: where versions live (``<filepath>/<version>/<basename>``).
        version: Kedro version (set by the catalog when ``versioned: true``).
        producer: the pipeline that writes it, named in the error when nothing is there yet.
    """

    def __init__(
        self,
        *,
        filepath: str,
        version: Version | None = None,
        producer: str = "qerl_train",
        metadata: dict[str, Any] | None = None,
    ) -> None:
        self._filepath = PurePosixPath(filepath)
        self._version = version
        self._producer = producer
        self._skipped = False
        self.metadata = metadata

    def _versions(self) -> list[str]:
        root = Path(self._filepath)
        if not self._version:
            return []
        found = [p.parent.name for p in root.glob(f"*/{root.name}") if p.exists()]
        return sorted(found, reverse=True)

    def list_versions(self, full_path: bool = False) -> list[str]:
        """Versions newest first (timestamps, or full paths with ``full_path=True``)."""
        names = self._versions()
        return [str(Path(self._filepath) / v / self._filepath.name) for v in names] if full_path else names

    def _load_path(self) -> Path:
        if not self._version:
            return Path(self._filepath)
        if self._version.load:
            return Path(self._filepath) / self._version.load / self._filepath.name
        versions = self._versions()
        if not versions:
            raise DatasetError(
                f"no version of {self._filepath} exists yet; it is written by "
                f"`kedro run --pipeline={self._producer}`: run that first"
            )
        return Path(self._filepath) / versions[0] / self._filepath.name

    def load(self) -> pd.DataFrame:
        if self._skipped:
            return SKIPPED
        path = self._load_path()
        if not path.exists():
            raise DatasetError(f"{path} does not exist; it is written by `kedro run --pipeline={self._producer}`")
        return pd.read_parquet(path)

    def save(self, data: pd.DataFrame) -> None:
        if is_skipped(data):
            self._skipped = True
            return
        self._skipped = False
        if self._version:
            from kedro.io.core import generate_timestamp

            version = self._version.save or generate_timestamp()
            path = Path(self._filepath) / version / self._filepath.name
        else:
            path = Path(self._filepath)
        if self._version and path.exists():
            raise DatasetError(f"save path {path} must not exist if versioning is enabled")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".partial-", dir=path.parent)
        os.close(fd)
        try:
            data.to_parquet(tmp, index=False)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _exists(self) -> bool:
        try:
            return self._load_path().exists()
        except DatasetError:
            return False

    def _describe(self) -> dict[str, Any]:
        return {"filepath": str(self._filepath), "version": self._version, "producer": self._producer}
