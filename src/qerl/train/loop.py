"""The whole QeRL loop, readable top to bottom, usable without Kedro::

    from qerl.params import RLParams, RolloutParams, TrainParams
    from qerl.train.loop import train
    policy, state = train(TrainParams(rl={"steps": 100}), train_prompts)

``train_prompts`` is a prompt table (``qerl.data.schema``), e.g. from
``qerl.data.sources.build_prompt_tables``. One RL step is :func:`run_step`: rollouts (stage 3,
``qerl.train.generate``) -> rewards (stage 4, ``qerl.train.score``) -> LoRA update (stage 5,
``qerl.train.update``) -> :func:`finish_step` (history, noise feedback, checkpoint). The Kedro
pipeline ``qerl_train`` runs exactly these functions, one node per stage, repeated by
``qerl.runner.LoopRunner``.

Data parallel: ``torchrun --nproc_per_node=N`` around a script that calls :func:`train` (or around
``kedro run``) trains on N ranks, each generating a shard of every step's prompts; see
``qerl.train.distributed`` and docs/distributed.md.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from qerl.noise.schedules import build_schedule
from qerl.train import distributed as dist
from qerl.train.checkpoints import CheckpointStore, RunDir, run_identity
from qerl.train.generate import rollout_step, select_prompts
from qerl.train.metrics import ROLLOUT_ENTROPY, console_line
from qerl.train.policy import Policy, build_policy_for
from qerl.train.score import score_step
from qerl.train.seeds import derive_seed
from qerl.train.state import TrainState, build_optimizer, build_scheduler
from qerl.train.update import update_step

if TYPE_CHECKING:
    from collections.abc import Callable

    from qerl.params import RLParams, RolloutParams, TrainParams

log = logging.getLogger(__name__)

DEFAULT_CHECKPOINTS = "data/06_models/checkpoints"


@dataclass
class RunContext:
    """Everything a step needs: the settings, the policy, the run's state and its prompts."""

    params: TrainParams
    policy: Policy
    state: TrainState
    prompts: pd.DataFrame


# ------------------------------------------------------------------------------------ start


def start_run(policy: Policy, params: TrainParams, prompts: pd.DataFrame, store: CheckpointStore) -> TrainState:
    """A fresh :class:`TrainState` for this configuration, or its newest good checkpoint
    (``rl.resume: auto``). Logs which run it starts or resumes, and why."""
    from qerl.rewards.base import check_reward_columns

    check_reward_columns(params.rewards.specs(), prompts.columns)
    dist.barrier()  # under torchrun: rank 0's checkpoint writes are complete before any rank reads
    rl = params.rl
    identity = run_identity(params, prompts)
    run = store.run_for(params, prompts)
    opt = build_optimizer(policy.lora_parameters(), rl.optimizer, rl.lr, rl.weight_decay)
    sched = build_scheduler(opt, rl.steps * rl.epochs * rl.minibatches, rl.warmup_ratio, rl.lr_schedule)
    state = TrainState(run=run, total_steps=rl.steps, save_every=rl.save_every, adapter_every=rl.adapter_every,
                       optimizer=opt, scheduler=sched, noise=build_schedule(params.noise, rl.steps))
    if rl.resume == "never":
        run.archive()
    ckpt = run.latest_good_checkpoint() if rl.resume == "auto" else None
    if ckpt is not None:
        restore(policy, state, ckpt)
        state.first_step = state.step
        log.info("resuming run %s from step %d/%d (%s)", run.key, state.step, rl.steps, ckpt.path)
    else:
        why = "rl.resume=never" if rl.resume == "never" else store.explain(run, identity)
        log.info("starting run %s (%d steps): %s", run.key, rl.steps, why)
        run.write_info({"identity": identity, "settings": params.model_dump(mode="json"), "policy": policy.identity()})
        run.save_adapter_snapshot(policy, 0)  # the seeded initialisation: what a replay of step 1 samples from
    _check_ranks_start_alike(policy, state, store)
    return state


def _check_ranks_start_alike(policy: Policy, state: TrainState, store: CheckpointStore) -> None:
    """Under ``torchrun`` every rank must start from rank 0's step and adapter (a resume reads rank 0's
    checkpoint, so the checkpoint root must be one every node sees)."""
    fix = (f"put the checkpoint root {store.root} on a filesystem every node sees (or start over with "
           "--params qerl.rl.resume=never)")
    dist.check_same(state.step, "checkpoints", "the ranks resume from different steps", fix)
    checksum = sum(float(p.detach().double().abs().sum()) for p in policy.lora_parameters())
    dist.check_same(checksum, "checkpoints", "the ranks start from different adapters", fix)


def restore(policy: Policy, state: TrainState, ckpt: Any) -> None:
    """Load a checkpoint's adapter, optimizer, scheduler, noise state and history into the run."""
    meta = ckpt.meta
    policy.load_adapter_state_dict(ckpt.adapter)
    if state.optimizer is not None and ckpt.optim.get("optimizer"):
        state.optimizer.load_state_dict(ckpt.optim["optimizer"])
    if state.scheduler is not None and ckpt.optim.get("scheduler"):
        state.scheduler.load_state_dict(ckpt.optim["scheduler"])
    if meta.get("noise") and hasattr(state.noise, "load_state_dict"):
        state.noise.load_state_dict(meta["noise"])
    state.step = int(meta["step"])
    state.history = [h for h in meta.get("history", []) if int(h.get("step", 0)) <= state.step]
    state.bad_steps_total = int(meta.get("bad_steps_total", 0))
    state.checkpoint_dir = str(ckpt.path)


def replay_state(policy: Policy, params: TrainParams, prompts: pd.DataFrame, store: CheckpointStore,
                 step: int | None) -> TrainState:
    """The state of a single-node replay of ``step`` (default: the run's last step) of this
    configuration's run: its policy carries the adapter that produced that step (the one after
    step - 1), and the run's base must be the policy's. Logged; refused with a clear error otherwise."""
    from qerl.errors import QerlConfigError

    run = store.run_for(params, prompts)
    if not run.exists():
        names = [r.key for r in store.runs(params.rl.run_name)]
        raise QerlConfigError("replay", f"no run of this configuration ({run.key}) exists under {store.root}"
                              + (f"; runs of that name: {', '.join(names)}" if names else ""),
                              "train it first with `kedro run --pipelines=qerl_train` (same parameters)")
    trained = [int(h["step"]) for h in _history(run)]
    last = max(trained, default=0)
    step = step or last
    if step < 1 or step > max(last, 1):
        raise QerlConfigError("replay.step", f"is {step} but run {run.key} trained steps 1..{last}",
                              f"use --params replay.step=<1..{last}>")
    used = run.info().get("policy", {})
    if used and used != policy.identity():
        diff = sorted(k for k in used if used.get(k) != policy.identity().get(k))
        raise QerlConfigError("policy", f"the saved policy differs from the one run {run.key} trained ({', '.join(diff)})",
                              "rebuild it with `kedro run --pipelines=qerl_train --nodes=setup_quantized_policy` "
                              "using the run's parameters")
    policy.load_adapter_state_dict(run.adapter_after(step - 1))
    noise = build_schedule(params.noise, params.rl.steps)
    hist = {int(h["step"]): h for h in _history(run)}
    if hasattr(noise, "load_state_dict") and step - 1 in hist and "noise/state" in hist[step - 1]:
        noise.load_state_dict(hist[step - 1]["noise/state"])
    log.info("replaying step %d of run %s with the adapter after step %d (the one that produced step %d); "
             "its outputs are saved as replay versions", step, run.key, step - 1, step)
    return TrainState(run=run, total_steps=params.rl.steps, save_every=params.rl.save_every, step=step - 1,
                      noise=noise, resident=False, replay_step=step)


def _history(run: RunDir) -> list[dict[str, Any]]:
    steps = run.checkpoint_steps()
    return run.load_checkpoint(steps[-1]).meta.get("history", []) if steps else []


# ------------------------------------------------------------------------------------ one step


def generate(policy: Policy, state: TrainState, prompts: pd.DataFrame, rollout: RolloutParams, rl: RLParams) -> pd.DataFrame:
    """Stage 3 for the state's next step (or its replay step); under ``torchrun`` this rank's
    contiguous shard of the step's prompts (whole groups)."""
    from qerl.errors import QerlConfigError

    if not state.resident and dist.world_size() > 1:
        raise QerlConfigError("replay", f"a replay regenerates a step in one process, not on {dist.world_size()} ranks",
                              "run it without torchrun (or with --nproc_per_node=1 for a run trained under torchrun)")
    step = state.replay_step or state.step + 1
    _seed_global_rngs(rl.seed, step)
    sigma = state.noise.sigma(step - 1)  # AQN: stage 0 noise-free, then decaying; the same on every rank
    chosen = select_prompts(prompts, step, rl.prompts_per_step, rl.seed)
    lo, hi = dist.shard(len(chosen))
    table = rollout_step(policy, chosen.iloc[lo:hi].reset_index(drop=True), step, sigma, rollout, rl.seed, first=lo)
    table.insert(0, "run", state.run.key)
    table["replay"] = not state.resident
    return table




def finish_step(policy: Policy, state: TrainState, row: dict[str, Any]) -> None:
    """Advance the step counter, record the row, feed the noise controller the *rollout* entropy,
    snapshot the adapter and checkpoint when due, and log one line with the ETA."""
    state.step = int(row["step"])
    if hasattr(state.noise, "observe"):
        state.noise.observe(state.step, row.get(ROLLOUT_ENTROPY))
        if hasattr(state.noise, "state_dict") and getattr(state.noise, "num_updates", None) is not None:
            row["noise/state"] = state.noise.state_dict()
    state.history.append(row)
    if state.should_snapshot_adapter():
        state.run.save_adapter_snapshot(policy, state.step)
    if state.should_checkpoint():
        state.checkpoint_dir = str(state.run.save_checkpoint(policy, state.meta(), state.optim_state()))
    eta = None
    if state.step > state.first_step:
        eta = (time.perf_counter() - state.started) / (state.step - state.first_step) * (state.total_steps - state.step)
    log.info(console_line(row, state.total_steps, eta))


def run_step(ctx: RunContext) -> dict[str, Any]:
    """One RL step: rollouts -> rewards -> update -> bookkeeping. Returns the metrics row."""
    p = ctx.params
    rollouts = generate(ctx.policy, ctx.state, ctx.prompts, p.rollout, p.rl)
    scored = score_step(rollouts, p.rewards, p.rl)
    row = update_step(ctx.policy, ctx.state, scored, p.rl, p.rollout)
    finish_step(ctx.policy, ctx.state, row)
    return row


def train(params: TrainParams, prompts: pd.DataFrame, on_step: Callable[[dict[str, Any]], None] | None = None, *,
          checkpoint_root: str = DEFAULT_CHECKPOINTS, policy: Policy | None = None) -> tuple[Policy, TrainState]:
    """Build the 4-bit LoRA policy (unless given), start or resume the run, step until done (under
    ``torchrun``: on every rank, data parallel)."""
    dist.init_from_env()
    dist.check_world(params.rl.prompts_per_step, params.model.device)
    if policy is None:
        policy, _ = build_policy_for(params)
    state = start_run(policy, params, prompts, CheckpointStore(checkpoint_root))
    ctx = RunContext(params, policy, state, prompts)
    while not state.done:
        row = run_step(ctx)
        if on_step is not None:
            on_step(row)
    return policy, state


def metrics_table(state: TrainState) -> pd.DataFrame:
    """The per-step metrics table of the run (each step once, also across a resume)."""
    from qerl.errors import QerlConfigError

    if not state.history:
        raise QerlConfigError("qerl.rl.steps", "the run recorded no steps", "run at least one step")
    df = pd.DataFrame([{k: v for k, v in h.items() if k != "noise/state"} for h in state.history])
    df = df.drop_duplicates("step", keep="last").sort_values("step")
    df.insert(0, "run", state.run.key)
    return df.reset_index(drop=True)


def _seed_global_rngs(seed: int, step: int) -> None:
    """Global RNGs (anything that draws without a generator, e.g. a reward function) are re-seeded
    per step, so they too do not depend on where a run was resumed."""
    s = derive_seed(seed, step, "sampling")
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s & 0xFFFFFFFF)
