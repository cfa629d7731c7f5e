"""Where a run lives on disk, and the one way to find it: ``<root>/<run_name>/<fingerprint>/``.

The fingerprint hashes everything that changes the training path (the ``qerl`` settings except
reporting/bookkeeping fields, the training prompts' content, the base model's content), so a changed
configuration never resumes an old run, and training, resume and single-node replays all find
runs through :meth:`CheckpointStore.run_for`. A run directory holds::

    run.json                       the run's settings snapshot (``qerl`` + data), its identity
    step_000010/                   a full checkpoint every rl.save_every steps:
        adapter_config.json        peft's own adapter format (``PeftModel.from_pretrained`` loads it)
        adapter_model.safetensors
        qerl_state.json            step, metric history, noise-controller state, counters
        qerl_optimizer.pt          optimizer + LR-scheduler state (written here, loaded weights_only)
    adapters/step_000004/          the adapter after every rl.adapter_every steps (step 0 = the
                                   seeded initialisation): what a replay of step 5 samples from
    eval_before.json               the held-out evaluation of the untrained policy
    complete.json                  written last: the run finished and its outputs were saved

Every directory is written atomically (``qerl.atomic``). Loading validates the files first and never
unpickles anything but tensors; a corrupt newest checkpoint falls back to the previous good one.
Under ``torchrun`` only rank 0 writes (every writing method is a no-op on the other ranks, which
read rank 0's files when they resume).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from qerl.atomic import atomic_directory, atomic_write
from qerl.errors import QerlConfigError
from qerl.train.distributed import is_main

if TYPE_CHECKING:
    from qerl.params import TrainParams
    from qerl.train.policy import Policy

log = logging.getLogger(__name__)

STEP_PREFIX = "step_"
RUN_FILE = "run.json"
STATE_FILE = "qerl_state.json"
OPTIM_FILE = "qerl_optimizer.pt"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
COMPLETE_FILE = "complete.json"
EVAL_BEFORE_FILE = "eval_before.json"

# Settings that do not change the training path (reporting, bookkeeping, where it runs).
NOT_IN_FINGERPRINT: dict[str, Any] = {
    "report": True, "eval": True, "model": {"device"}, "quant": {"backend"},
    "rl": {"run_name", "save_every", "adapter_every", "resume", "max_bad_steps"},
}


def fingerprint(obj: Any) -> str:
    """A short stable hash of a JSON-able object."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def prompts_digest(prompts: pd.DataFrame) -> str:
    """Hash of the training prompts' content (ids, prompts, answers, in order)."""
    h = hashlib.sha256()
    for col in ("id", "prompt", "answer"):
        if col in prompts:
            h.update("\x1f".join(map(str, prompts[col].tolist())).encode())
    return h.hexdigest()[:16]


def model_digest(path: str | os.PathLike[str], sample: int = 1 << 20) -> str:
    """Hash of a model directory's content: config.json, and each weight file's size, head and tail
    (``sample`` bytes each: a rebuilt model changes it, a 72B model is not read whole)."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(root.glob("*.json")) + sorted(root.glob("*.safetensors")):
        h.update(f.name.encode())
        size = f.stat().st_size
        h.update(str(size).encode())
        with open(f, "rb") as fh:
            h.update(fh.read(sample))
            if size > 2 * sample:
                fh.seek(size - sample)
                h.update(fh.read(sample))
    return h.hexdigest()[:16]


def run_identity(params: TrainParams, prompts: pd.DataFrame) -> dict[str, Any]:
    """Everything the run's fingerprint covers, as plain JSON."""
    return {
        "qerl": params.model_dump(mode="json", exclude=NOT_IN_FINGERPRINT),
        "prompts": prompts_digest(prompts),
        "model": model_digest(params.model.path) if Path(params.model.path).is_dir() else params.model.path,
    }


@dataclass(frozen=True)
class Checkpoint:
    """One loaded checkpoint."""

    path: Path
    step: int
    meta: dict[str, Any]
    adapter: dict[str, torch.Tensor]
    optim: dict[str, Any]


class RunDir:
    """One run (run name + fingerprint) on disk."""

    def __init__(self, root: Path, run_name: str, fp: str) -> None:
        self.root, self.run_name, self.fingerprint = root, run_name, fp
        self.path = root / run_name / fp

    @property
    def key(self) -> str:
        return f"{self.run_name}/{self.fingerprint}"

    def __repr__(self) -> str:
        return f"RunDir({self.path})"

    # -- run record ------------------------------------------------------------------------------

    def exists(self) -> bool:
        return (self.path / RUN_FILE).exists()

    def write_info(self, info: dict[str, Any]) -> None:
        if not is_main():
            return
        self.path.mkdir(parents=True, exist_ok=True)
        write_json(self.path / RUN_FILE, {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), **info})

    def info(self) -> dict[str, Any]:
        return read_json(self.path / RUN_FILE) if self.exists() else {}

    def archive(self) -> Path | None:
        """Move an existing run directory aside (``rl.resume: never`` starts this configuration over;
        its old checkpoints must not be resumed later). Returns where it went."""
        if not self.path.exists() or not is_main():
            return None
        dest = self.path.with_name(f"{self.fingerprint}.replaced-{time.strftime('%Y%m%dT%H%M%S')}")
        os.replace(self.path, dest)
        log.info("rl.resume=never: moved the earlier run %s aside to %s", self.key, dest)
        return dest

    def is_complete(self) -> bool:
        return (self.path / COMPLETE_FILE).exists()

    def mark_complete(self, summary: dict[str, Any]) -> None:
        if not is_main():
            return
        write_json(self.path / COMPLETE_FILE, {"finished": time.strftime("%Y-%m-%dT%H:%M:%S"), **summary})

    def completion(self) -> dict[str, Any]:
        return read_json(self.path / COMPLETE_FILE) if self.is_complete() else {}

    def save_eval_before(self, table: pd.DataFrame) -> None:
        if not is_main():
            return
        write_json(self.path / EVAL_BEFORE_FILE, table.to_dict(orient="records"))

    def eval_before(self) -> pd.DataFrame | None:
        f = self.path / EVAL_BEFORE_FILE
        return pd.DataFrame(read_json(f)) if f.exists() else None

    # -- checkpoints -----------------------------------------------------------------------------

    def checkpoint_steps(self) -> list[int]:
        """Steps of the complete checkpoints (oldest first)."""
        if not self.path.exists():
            return []
        return sorted(int(p.name[len(STEP_PREFIX):]) for p in self.path.glob(f"{STEP_PREFIX}*")
                      if (p / STATE_FILE).exists())

    def save_checkpoint(self, policy: Policy, meta: dict[str, Any], optim: dict[str, Any]) -> Path:
        """Write the full checkpoint of ``meta['step']`` atomically."""
        final = self.path / f"{STEP_PREFIX}{int(meta['step']):06d}"
        if not is_main():
            return final
        with atomic_directory(final) as tmp:
            save_adapter(policy, tmp)
            torch.save(optim, tmp / OPTIM_FILE)
            (tmp / STATE_FILE).write_text(json.dumps(meta, default=_json_default))
        return final

    def load_checkpoint(self, step: int) -> Checkpoint:
        """Read (and validate) the checkpoint of ``step``; a clear error names a bad file."""
        p = self.path / f"{STEP_PREFIX}{step:06d}"
        meta = read_json(p / STATE_FILE)
        adapter = read_adapter(p)
        optim = _load_tensors_only(p / OPTIM_FILE)
        return Checkpoint(p, int(meta["step"]), meta, adapter, optim)

    def latest_good_checkpoint(self) -> Checkpoint | None:
        """The newest checkpoint that loads; a corrupt one is skipped with a warning."""
        for step in reversed(self.checkpoint_steps()):
            try:
                return self.load_checkpoint(step)
            except QerlConfigError as err:
                log.warning("checkpoint of step %d is unusable (%s); falling back to the previous one", step, err)
        return None

    # -- adapter snapshots (replays) -------------------------------------------------------------

    def save_adapter_snapshot(self, policy: Policy, step: int) -> Path:
        final = self.path / "adapters" / f"{STEP_PREFIX}{step:06d}"
        if not is_main():
            return final
        with atomic_directory(final) as tmp:
            save_adapter(policy, tmp)
        return final

    def adapter_steps(self) -> list[int]:
        """Steps after which the adapter is on disk (snapshots and full checkpoints)."""
        snaps = {int(p.name[len(STEP_PREFIX):]) for p in (self.path / "adapters").glob(f"{STEP_PREFIX}*")
                 if (p / ADAPTER_WEIGHTS).exists()} if (self.path / "adapters").exists() else set()
        return sorted(snaps | set(self.checkpoint_steps()))

    def adapter_after(self, step: int) -> dict[str, torch.Tensor]:
        """The adapter as it was after ``step`` (0 = the initialisation)."""
        for p in (self.path / "adapters" / f"{STEP_PREFIX}{step:06d}", self.path / f"{STEP_PREFIX}{step:06d}"):
            if (p / ADAPTER_WEIGHTS).exists():
                return read_adapter(p)
        have = self.adapter_steps()
        raise QerlConfigError(
            "replay.step", f"run {self.key} kept no adapter after step {step} (adapters are on disk after steps "
            f"{_ranges(have)})", "replay a step s with s-1 in that list, or train with a smaller rl.adapter_every")


class CheckpointStore:
    """The checkpoint root (the catalog's ``checkpoints`` entry) and the run finder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.root})"

    def run_for(self, params: TrainParams, prompts: pd.DataFrame) -> RunDir:
        """The run directory of this configuration (it may not exist yet)."""
        return RunDir(self.root, params.rl.run_name, fingerprint(run_identity(params, prompts)))

    def runs(self, run_name: str) -> list[RunDir]:
        """Every configuration of ``run_name`` on disk."""
        base = self.root / run_name
        if not base.exists():
            return []
        return [RunDir(self.root, run_name, p.name) for p in sorted(base.iterdir()) if (p / RUN_FILE).exists()]

    def explain(self, run: RunDir, identity: dict[str, Any]) -> str:
        """Why ``run`` starts fresh: which other configurations of its name exist and how they differ."""
        others = [r for r in self.runs(run.run_name) if r.fingerprint != run.fingerprint]
        if not others:
            return "no earlier run of this name"
        mine = _flatten(identity)
        lines = []
        for other in others[-3:]:
            theirs = _flatten(other.info().get("identity", {}))
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            lines.append(f"{other.fingerprint} (differs in {', '.join(diff[:6]) or 'unknown'})")
        return f"{len(others)} other configuration(s) of '{run.run_name}' exist: " + "; ".join(lines)


# ------------------------------------------------------------------------------ file helpers


def save_adapter(policy: Policy, out: Path) -> None:
    """peft's ``save_pretrained`` layout: adapter_config.json + adapter_model.safetensors."""
    policy.model.save_pretrained(str(out), safe_serialization=True)


def read_adapter(path: Path) -> dict[str, torch.Tensor]:
    """The adapter weights of a peft adapter directory (safetensors, validated)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    f = path / ADAPTER_WEIGHTS
    try:
        raw = load_file(str(f))
    except (SafetensorError, OSError, ValueError) as err:
        raise QerlConfigError(str(f), f"is not a readable safetensors file ({err})",
                              "delete this checkpoint directory; training resumes from the previous one") from None
    return raw


def _load_tensors_only(path: Path) -> dict[str, Any]:
    """``torch.load(weights_only=True)``: tensors and plain containers, never arbitrary objects."""
    import pickle

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as err:
        why = "holds objects this project did not write (refused: it never unpickles them)" \
            if "weights_only" in str(err) or "Unsupported" in str(err) else f"is unreadable ({type(err).__name__})"
        raise QerlConfigError(str(path), why, "delete this checkpoint directory; training resumes from the "
                              "previous one") from None


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=1, default=_json_default)))


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise QerlConfigError(str(path), f"is unreadable ({err})", "delete it (it is rewritten by the next run)") from None


def _json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, (np.floating, np.integer, np.bool_)):
        return obj.item()
    if isinstance(obj, torch.Tensor):
        return obj.item() if obj.numel() == 1 else obj.tolist()
    return str(obj)


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def _ranges(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) > 6:
        return f"{', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-2:]))}"
    return ", ".join(map(str, steps))
