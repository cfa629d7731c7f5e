"""Training state (optimizer, schedule, noise schedule, RNG, history) and atomic checkpoints.

A checkpoint is a directory ``<root>/<run_name>/<fingerprint>/step_<NNNNNN>/`` holding
``adapter.safetensors`` (LoRA weights), ``optimizer.pt`` (optimizer + LR scheduler state, written
by this project and loaded with ``weights_only=True``), ``rng.pt`` and ``trainer_state.json``
(step, metric history, noise-controller state). It is written into a hidden temporary directory
and renamed into place, so a killed process never leaves a half-written checkpoint that resume
could pick up.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from qerl.atomic import atomic_directory
from qerl.errors import QerlConfigError

STEP_PREFIX = "step_"


@dataclass
class TrainState:
    """Mutable state of one RL run, shared by the rollout / reward / update stages."""

    run_name: str
    fingerprint: str
    total_steps: int
    save_every: int
    step: int = 0
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    noise: Any = None
    history: list[dict[str, Any]] = field(default_factory=list)
    bad_steps_in_row: int = 0
    bad_steps_total: int = 0
    resident: bool = True
    adapter: dict[str, torch.Tensor] | None = None  # set when loaded from disk, not live
    checkpoint_dir: str | None = None

    def should_checkpoint(self) -> bool:
        return self.step > 0 and (self.step % self.save_every == 0 or self.step == self.total_steps)


def fingerprint(config: dict[str, Any]) -> str:
    """A short stable hash of the settings that define a run (resume only matches the same run)."""
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


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


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def run_dir(root: str | os.PathLike, run_name: str, fp: str) -> Path:
    return Path(root) / run_name / fp


def save_checkpoint(state: TrainState, adapter: dict[str, torch.Tensor], root: str | os.PathLike) -> Path:
    """Write the checkpoint for ``state.step`` atomically and return its directory."""
    final = run_dir(root, state.run_name, state.fingerprint) / f"{STEP_PREFIX}{state.step:06d}"
    with atomic_directory(final) as tmp:
        save_file({k: v.contiguous() for k, v in adapter.items()}, str(tmp / "adapter.safetensors"))
        torch.save(
            {
                "optimizer": state.optimizer.state_dict() if state.optimizer else None,
                "scheduler": state.scheduler.state_dict() if state.scheduler else None,
            },
            tmp / "optimizer.pt",
        )
        torch.save(_picklable_rng(rng_state()), tmp / "rng.pt")
        meta = {
            "step": state.step,
            "run_name": state.run_name,
            "fingerprint": state.fingerprint,
            "total_steps": state.total_steps,
            "bad_steps_total": state.bad_steps_total,
            "noise": state.noise.state_dict() if hasattr(state.noise, "state_dict") else None,
            "history": state.history,
        }
        (tmp / "trainer_state.json").write_text(json.dumps(meta, default=_json_default))
    return final


def list_checkpoints(root: str | os.PathLike, run_name: str, fp: str | None = None) -> list[Path]:
    """Complete checkpoints of a run (newest step last); ``fp=None`` searches every fingerprint."""
    base = Path(root) / run_name
    if not base.exists():
        return []
    pattern = f"{fp}/{STEP_PREFIX}*" if fp else f"*/{STEP_PREFIX}*"
    found = [p for p in base.glob(pattern) if (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: (int(p.name[len(STEP_PREFIX) :]), p.stat().st_mtime))


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a checkpoint directory written by :func:`save_checkpoint` (no arbitrary unpickling)."""
    p = Path(path)
    meta = json.loads((p / "trainer_state.json").read_text())
    return {
        "meta": meta,
        "adapter": load_file(str(p / "adapter.safetensors")),
        "optim": torch.load(p / "optimizer.pt", weights_only=True),
        "rng": _unpicklable_rng(torch.load(p / "rng.pt", weights_only=True)),
        "path": str(p),
    }


def _picklable_rng(state: dict[str, Any]) -> dict[str, Any]:
    """RNG state as tensors/ints/lists only, so it loads with ``torch.load(weights_only=True)``."""
    version, internal, gauss = state["python"]
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    out = {
        "torch": state["torch"],
        "python": [version, list(internal), gauss],
        "numpy": [np_name, torch.from_numpy(np_keys.astype(np.int64)), int(np_pos), int(np_has_gauss), float(np_gauss)],
    }
    if "cuda" in state:
        out["cuda"] = list(state["cuda"])
    return out


def _unpicklable_rng(saved: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`_picklable_rng`."""
    version, internal, gauss = saved["python"]
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = saved["numpy"]
    out = {
        "torch": saved["torch"],
        "python": (version, tuple(internal), gauss),
        "numpy": (np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss),
    }
    if "cuda" in saved:
        out["cuda"] = saved["cuda"]
    return out


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    return str(obj)
