"""A local Hugging Face model directory (``save_pretrained`` layout, safetensors) as a catalog entry."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from kedro.io.core import AbstractDataset, DatasetError

from qerl.atomic import atomic_directory


class HFModelDataset(AbstractDataset[dict[str, Any], dict[str, Any]]):
    """Saves ``{"model": ..., "tokenizer": ...}`` with ``save_pretrained`` (written to a temporary
    directory, then renamed into place); loads them back with local files only and no remote code."""

    def __init__(self, *, path: str, metadata: dict[str, Any] | None = None) -> None:
        self._path = PurePosixPath(path)
        self.metadata = metadata

    def load(self) -> dict[str, Any]:
        from qerl.modeling.tiny import load_tiny

        path = Path(self._path)
        if not (path / "config.json").exists():
            raise DatasetError(f"no model at {path}: it is written by `kedro run --pipeline=embedded_model`")
        model, tokenizer = load_tiny(path)
        return {"model": model, "tokenizer": tokenizer, "path": str(path)}

    def save(self, data: dict[str, Any]) -> None:
        with atomic_directory(Path(self._path)) as tmp:
            data["model"].save_pretrained(tmp, safe_serialization=True)
            data["tokenizer"].save_pretrained(tmp)

    def _exists(self) -> bool:
        return (Path(self._path) / "config.json").exists()

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path)}
