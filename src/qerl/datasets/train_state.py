"""The training-state hand-off between unrolled RL steps.

In a run, each step's ``lora_rl_update`` node saves the (same, mutable) ``TrainState`` and the
next step's nodes load it back: resident, no copy. A node rerun alone in a fresh process
(``kedro run --nodes=step_0005.generate_rollouts``) has no resident state; ``load`` then returns
the newest checkpoint under ``checkpoint_root`` as a non-resident state carrying its adapter
weights, which the node loads into the policy.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from kedro.io.core import AbstractDataset, DatasetError

from qerl.train.state import STEP_PREFIX, TrainState, load_checkpoint


class TrainStateDataset(AbstractDataset[TrainState, TrainState]):
    """Resident ``TrainState``; falls back to the latest checkpoint on disk."""

    def __init__(self, *, checkpoint_root: str, metadata: dict[str, Any] | None = None) -> None:
        self._root = PurePosixPath(checkpoint_root)
        self._state: TrainState | None = None
        self.metadata = metadata

    def load(self) -> TrainState:
        if self._state is not None:
            return self._state
        latest = latest_checkpoint(Path(self._root))
        if latest is None:
            raise DatasetError(
                f"no checkpoint under {self._root}: checkpoints are written by the lora_rl_update nodes of "
                "`kedro run --pipeline=qerl_train` (every rl.save_every steps); run that first"
            )
        ckpt = load_checkpoint(latest)
        meta = ckpt["meta"]
        return TrainState(
            run_name=meta["run_name"], fingerprint=meta["fingerprint"], total_steps=meta["total_steps"],
            save_every=1, step=int(meta["step"]), history=meta.get("history", []),
            resident=False, adapter=ckpt["adapter"], checkpoint_dir=str(latest), noise=meta.get("noise"),
        )

    def save(self, data: TrainState) -> None:
        self._state = data

    def release(self) -> None:
        self._state = None

    def _exists(self) -> bool:
        return self._state is not None or latest_checkpoint(Path(self._root)) is not None

    def _describe(self) -> dict[str, Any]:
        return {"checkpoint_root": str(self._root), "resident": self._state is not None}


def latest_checkpoint(root: Path) -> Path | None:
    """The most recently written complete checkpoint of any run under ``root``."""
    found = [p for p in root.glob(f"*/*/{STEP_PREFIX}*") if (p / "trainer_state.json").exists()]
    return max(found, key=lambda p: (p / "trainer_state.json").stat().st_mtime, default=None)
