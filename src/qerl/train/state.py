"""The mutable state of one RL run (optimizer, LR schedule, noise schedule, metric history) and the
builders of its optimizer and schedule. Where it is saved: :mod:`qerl.train.checkpoints`."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from qerl.errors import QerlConfigError
from qerl.train.checkpoints import RunDir


@dataclass
class TrainState:
    """Mutable state of one RL run, shared by the rollout / reward / update stages.

    ``resident`` is True for the live state of a training process; a state rebuilt for a
    single-node replay is not (it has no optimizer and ``replay_step`` says which step it replays).
    """

    run: RunDir
    total_steps: int
    save_every: int
    adapter_every: int = 1
    step: int = 0
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    noise: Any = None
    history: list[dict[str, Any]] = field(default_factory=list)
    bad_steps_in_row: int = 0
    bad_steps_total: int = 0
    resident: bool = True
    replay_step: int | None = None
    checkpoint_dir: str | None = None
    started: float = field(default_factory=time.perf_counter)  # for the ETA
    first_step: int = 0  # the step this process started from (after a resume)

    @property
    def done(self) -> bool:
        """Every step of the run is trained (the loop runner stops here)."""
        return self.resident and self.step >= self.total_steps

    @property
    def run_name(self) -> str:
        return self.run.run_name

    @property
    def fingerprint(self) -> str:
        return self.run.fingerprint

    def should_checkpoint(self) -> bool:
        return self.step > 0 and (self.step % self.save_every == 0 or self.step == self.total_steps)

    def should_snapshot_adapter(self) -> bool:
        return self.step % self.adapter_every == 0 or self.step == self.total_steps

    def meta(self) -> dict[str, Any]:
        """What a checkpoint's ``qerl_state.json`` holds."""
        return {
            "step": self.step, "run_name": self.run_name, "fingerprint": self.fingerprint,
            "total_steps": self.total_steps, "bad_steps_total": self.bad_steps_total,
            "noise": self.noise.state_dict() if hasattr(self.noise, "state_dict") else None,
            "history": self.history,
        }

    def optim_state(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict() if self.optimizer else None,
                "scheduler": self.scheduler.state_dict() if self.scheduler else None}


def build_optimizer(params: list[torch.nn.Parameter], kind: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW over the LoRA parameters; ``adamw8bit`` uses bitsandbytes' 8-bit AdamW."""
    if not params:
        raise QerlConfigError("lora.target_modules", "the policy has no trainable LoRA parameters", "target at least one Linear")
    if kind == "adamw8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float, kind: str
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_ratio`` of the optimizer steps, then cosine decay to 0 (or constant)."""
    warmup = int(round(warmup_ratio * total_steps))

    def factor(i: int) -> float:
        if warmup and i < warmup:
            return (i + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = (i - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
