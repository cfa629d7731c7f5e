"""The checkpoint root and the training-state hand-off as catalog entries.

``checkpoints`` (:class:`CheckpointStoreDataset`) is THE checkpoint root: the nodes that start,
resume or replay a run load a :class:`~qerl.train.checkpoints.CheckpointStore` from it. The
``train_state`` entry (:class:`TrainStateDataset`) hands the live, mutable ``TrainState`` from
``start_training`` through every repetition of the RL loop (resident: no copy, no reload). A node
rerun alone in a new process has no live state: ``load`` then returns a :class:`ReplayHandle` on the
same root, from which the node rebuilds the state of the step it replays.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from kedro.io.core import AbstractDataset, DatasetError

from qerl.train.checkpoints import CheckpointStore


class CheckpointStoreDataset(AbstractDataset[None, CheckpointStore]):
    """Loads the :class:`CheckpointStore` rooted at ``path`` (written by the training nodes, not here)."""

    def __init__(self, *, path: str, metadata: dict[str, Any] | None = None) -> None:
        self._path = PurePosixPath(path)
        self.metadata = metadata

    def load(self) -> CheckpointStore:
        return CheckpointStore(Path(self._path))

    def save(self, data: None) -> None:
        raise DatasetError("checkpoints is written by the training nodes through its CheckpointStore, not saved")

    def _exists(self) -> bool:
        return True

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path)}


@dataclass(frozen=True)
class ReplayHandle:
    """What ``train_state`` loads in a process with no live training state (a single-node replay)."""

    store: CheckpointStore
    resident: bool = False


class TrainStateDataset(AbstractDataset[Any, Any]):
    """Resident ``TrainState`` within a run; a :class:`ReplayHandle` on ``checkpoints`` otherwise."""

    rank_aware = True  # in memory: the same on every rank under torchrun (qerl.runner keeps it)

    def __init__(self, *, checkpoints: str, metadata: dict[str, Any] | None = None) -> None:
        self._root = PurePosixPath(checkpoints)
        self._state: Any = None
        self.metadata = metadata

    def load(self) -> Any:
        if self._state is not None:
            return self._state
        return ReplayHandle(CheckpointStore(Path(self._root)))

    def save(self, data: Any) -> None:
        self._state = data

    def release(self) -> None:
        self._state = None

    def _exists(self) -> bool:
        return self._state is not None

    def _describe(self) -> dict[str, Any]:
        return {"checkpoints": str(self._root), "resident": self._state is not None}
