"""Run bookkeeping around the three step stages: start or resume a run, close a step
(history, noise feedback, checkpoint, progress line), and bring a checkpoint back into a policy.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from qerl.train.policy import Policy
from qerl.train.state import (
    TrainState,
    build_optimizer,
    build_scheduler,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
)

log = logging.getLogger(__name__)


def start_run(
    policy: Policy,
    *,
    run_name: str,
    fingerprint: str,
    total_steps: int,
    save_every: int,
    optimizer: str,
    lr: float,
    weight_decay: float,
    warmup_ratio: float,
    lr_schedule: str,
    optimizer_steps_per_step: int,
    noise: Any,
    checkpoint_root: str | os.PathLike,
    resume: str = "auto",
) -> TrainState:
    """A fresh :class:`TrainState`, or the latest matching checkpoint's when ``resume='auto'``."""
    opt = build_optimizer(policy.lora_parameters(), optimizer, lr, weight_decay)
    sched = build_scheduler(opt, total_steps * optimizer_steps_per_step, warmup_ratio, lr_schedule)
    state = TrainState(
        run_name=run_name, fingerprint=fingerprint, total_steps=total_steps, save_every=save_every,
        optimizer=opt, scheduler=sched, noise=noise,
    )
    found = list_checkpoints(checkpoint_root, run_name, fingerprint) if resume == "auto" else []
    if found:
        restore(policy, state, load_checkpoint(found[-1]))
        log.info("resuming run %s/%s from step %d (%s)", run_name, fingerprint, state.step, found[-1])
    return state


def restore(policy: Policy, state: TrainState, ckpt: dict[str, Any]) -> None:
    """Load a checkpoint's adapter, optimizer, scheduler, RNG, noise state and history."""
    meta = ckpt["meta"]
    policy.load_adapter_state_dict(ckpt["adapter"])
    if state.optimizer is not None and ckpt["optim"].get("optimizer"):
        state.optimizer.load_state_dict(ckpt["optim"]["optimizer"])
    if state.scheduler is not None and ckpt["optim"].get("scheduler"):
        state.scheduler.load_state_dict(ckpt["optim"]["scheduler"])
    if ckpt.get("rng"):
        set_rng_state(ckpt["rng"])
    if meta.get("noise") and hasattr(state.noise, "load_state_dict"):
        state.noise.load_state_dict(meta["noise"])
    state.step = int(meta["step"])
    state.history = [h for h in meta.get("history", []) if int(h.get("step", 0)) <= state.step]
    state.bad_steps_total = int(meta.get("bad_steps_total", 0))
    state.checkpoint_dir = ckpt["path"]


def sync_policy(policy: Policy, state: TrainState) -> None:
    """Make the policy carry the state's adapter (no-op for the live, resident state)."""
    if state.adapter is not None:
        policy.load_adapter_state_dict(state.adapter)
        state.adapter = None


def finish_step(policy: Policy, state: TrainState, metrics: dict[str, Any], checkpoint_root: str | os.PathLike) -> None:
    """Advance the step counter, record metrics, feed the noise controller, checkpoint when due."""
    state.step = int(metrics["step"])
    state.history.append(metrics)
    if hasattr(state.noise, "observe"):
        state.noise.observe(state.step, metrics.get("entropy"))
    if state.should_checkpoint():
        state.checkpoint_dir = str(save_checkpoint(state, policy.adapter_state_dict(), checkpoint_root))
    log.info(progress_line(metrics, state.total_steps))


def progress_line(m: dict[str, Any], total: int) -> str:
    """One console line per step: step, reward, entropy, sigma, tokens/s (+ loss, gap)."""
    return (
        f"step {m['step']:>4}/{total} | reward {m.get('reward_mean', float('nan')):.3f} "
        f"| entropy {m.get('entropy', float('nan')):.3f} | sigma {m.get('sigma', 0.0):.2e} "
        f"| tok/s {m.get('tokens_per_s', float('nan')):.0f} | loss {m.get('loss', float('nan')):+.4f} "
        f"| gap {m.get('logprob_gap_mean', float('nan')):.2e}"
    )
