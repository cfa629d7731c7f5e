"""Per-step tables of a run (the rollouts and scored rollouts of every RL step) as one catalog entry.

Layout under ``path``: ``<run_name>/<fingerprint>/step_<NNNNNN>/<timestamp>.parquet`` for the
training record and ``<timestamp>.replay.parquet`` for single-node replays; every file is written
atomically. Within a run, ``load`` returns the table the loop's previous node just saved (the
hand-off from ``generate_rollouts`` to ``score_rewards``). In a new process (a notebook, a replay)
``load`` returns the *training record* of the newest run: for every step its newest non-replay
version, concatenated (``load_args: {run: <name/fingerprint>, replays: true}`` pick another run or
the replays instead; :meth:`read` reads one step).

Under ``torchrun`` every rank saves its shard of the step (a collective): the file rank 0 writes holds
every rank's rows, in rank order (the whole step, as one process would have written it), and each
rank's in-memory hand-off stays its own shard.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

import pandas as pd
from kedro.io.core import AbstractDataset, DatasetError, generate_timestamp

from qerl.atomic import atomic_write
from qerl.train import distributed as dist

REPLAY_SUFFIX = ".replay.parquet"


class StepTablesDataset(AbstractDataset[pd.DataFrame, pd.DataFrame]):
    """See the module docstring. ``producer`` names the pipeline that writes the tables (for errors)."""

    rank_aware = True  # saved on every rank under torchrun (qerl.runner keeps it on ranks != 0)

    def __init__(self, *, path: str, load_args: dict[str, Any] | None = None, producer: str = "qerl_train",
                 metadata: dict[str, Any] | None = None) -> None:
        self._path = PurePosixPath(path)
        self._load_args = dict(load_args or {})
        self._producer = producer
        self._last: pd.DataFrame | None = None
        self.metadata = metadata

    # -- writing ---------------------------------------------------------------------------------

    def save(self, data: pd.DataFrame) -> None:
        self._last = data
        data = dist.gather_frames(data)  # the whole step under torchrun
        for col in ("run", "step"):
            if col not in data or data[col].nunique() != 1:
                raise DatasetError(f"{self._path}: a step table needs exactly one '{col}' value, got "
                                   f"{sorted(map(str, data[col].unique())) if col in data else 'no column'}")
        if not dist.is_main():
            return
        replay = bool(data["replay"].iloc[0]) if "replay" in data else False
        folder = Path(self._path) / str(data["run"].iloc[0]) / f"step_{int(data['step'].iloc[0]):06d}"
        name = generate_timestamp() + (REPLAY_SUFFIX if replay else ".parquet")
        atomic_write(folder / name, lambda tmp: data.to_parquet(tmp, index=False))

    # -- reading ---------------------------------------------------------------------------------

    def load(self) -> pd.DataFrame:
        if self._last is not None:
            return self._last
        run = self._load_args.get("run") or self.newest_run()
        steps = self.steps(run)
        if not steps:
            raise DatasetError(f"{self._path}: run {run} has no step tables; they are written by "
                               f"`kedro run --pipelines={self._producer}`")
        parts = [self.read(run, s, replays=bool(self._load_args.get("replays"))) for s in steps]
        parts = [p for p in parts if p is not None]
        if not parts:
            raise DatasetError(f"{self._path}: run {run} has no {'replay' if self._load_args.get('replays') else 'training'} tables")
        return pd.concat(parts, ignore_index=True)

    def runs(self) -> list[str]:
        """``name/fingerprint`` of every run with tables, oldest first (by last write)."""
        root = Path(self._path)
        found = [p for p in root.glob("*/*") if p.is_dir() and any(p.glob("step_*/*.parquet"))]
        found.sort(key=lambda p: max(f.stat().st_mtime for f in p.glob("step_*/*.parquet")))
        return [f"{p.parent.name}/{p.name}" for p in found]

    def newest_run(self) -> str:
        runs = self.runs()
        if not runs:
            raise DatasetError(f"no step tables under {self._path} yet; they are written by "
                               f"`kedro run --pipelines={self._producer}`: run that first")
        return runs[-1]

    def steps(self, run: str) -> list[int]:
        """Steps of ``run`` with at least one complete table."""
        return sorted(int(p.name[5:]) for p in (Path(self._path) / run).glob("step_*")
                      if p.is_dir() and any(not f.name.startswith(".") for f in p.glob("*.parquet")))

    def read(self, run: str, step: int, replays: bool = False) -> pd.DataFrame | None:
        """The newest training (or replay) version of ``step`` of ``run``, or None."""
        folder = Path(self._path) / run / f"step_{step:06d}"
        files = sorted(f for f in folder.glob("*.parquet") if f.name.endswith(REPLAY_SUFFIX) == replays
                       and not f.name.startswith("."))
        return pd.read_parquet(files[-1]) if files else None

    def release(self) -> None:
        self._last = None

    def _exists(self) -> bool:
        return self._last is not None or bool(self.runs())

    def _describe(self) -> dict[str, Any]:
        return {"path": str(self._path), "load_args": self._load_args, "producer": self._producer}
