"""Nodes of ``qerl_train``: thin wrappers that translate typed parameters and call the core
(``qerl.train``). The per-step nodes are made by :func:`step_node` so each unrolled step knows its
own number.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import pandas as pd

from qerl.datasets.step_table import SKIPPED, is_skipped
from qerl.errors import QerlConfigError
from qerl.noise.schedules import NoiseConfig, build_schedule
from qerl.params import TrainParams
from qerl.rewards.base import build_rewards
from qerl.rl.objective import ObjectiveConfig
from qerl.rollout import get_engine
from qerl.train import run as train_run
from qerl.train.policy import Policy, PolicySpec, build_policy
from qerl.train.state import TrainState, fingerprint
from qerl.train.steps import (
    RolloutConfig,
    UpdateConfig,
    rollout_step,
    score_step,
    select_prompts,
    update_step,
)

log = logging.getLogger(__name__)

CHECKPOINT_ROOT = "data/06_models/checkpoints"


# ---------------------------------------------------------------- translation of parameters


def policy_spec(p: TrainParams) -> PolicySpec:
    lora = p.lora.model_dump()
    if lora.get("preset") in (None, "default"):
        lora.pop("preset", None)
    return PolicySpec(
        model_path=p.model.path, format=p.quant.format, device=p.model.device, dtype=p.model.dtype,
        bnb_double_quant=p.quant.bnb_double_quant, on_indivisible=p.quant.on_indivisible,
        skip_modules=tuple(p.quant.skip_modules), lora=lora, gradient_checkpointing=p.rl.gradient_checkpointing,
    )


def objective_config(p: TrainParams) -> ObjectiveConfig:
    return ObjectiveConfig(
        loss_type=p.rl.loss_type, eps_low=p.rl.eps_low, eps_high=p.rl.eps_high, beta=p.rl.beta,
        entropy_coef=p.rl.entropy_coef, max_completion_length=p.rollout.max_new_tokens,
    )


def noise_config(p: TrainParams) -> NoiseConfig:
    n = p.noise
    return NoiseConfig(
        enabled=n.enabled, schedule=n.schedule, sigma_start=n.sigma_start, sigma_end=n.sigma_end,
        stages=n.stages, controller=dict(n.controller), seed=p.rl.seed,
    )


def rollout_config(p: TrainParams) -> RolloutConfig:
    r = p.rollout
    return RolloutConfig(
        group_size=r.group_size, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
        max_prompt_tokens=r.max_prompt_tokens, overlong_prompt=r.overlong_prompt,
    )


def run_fingerprint(p: TrainParams) -> str:
    """Settings that define a run: resume only continues a run with the same ones."""
    keep = p.model_dump(exclude={"report": True, "eval": True, "rl": {"save_every", "resume", "max_bad_steps"}})
    return fingerprint(keep)


def validate_train_params(p: TrainParams, n_rounds: int | None = None) -> None:
    """Every check that needs no model: runs first, so bad settings fail before any load."""
    objective_config(p).validate()
    noise_config(p).validate()
    build_schedule(noise_config(p), p.rl.steps)
    build_rewards([r.model_dump() for r in p.rewards.functions], "qerl.rewards.functions")
    if n_rounds is not None and n_rounds != p.rl.steps:
        raise QerlConfigError(
            "qerl.rl.steps",
            f"is {p.rl.steps} but the pipeline was unrolled into {n_rounds} steps when it was built",
            "run through `kedro run` (which builds the pipeline from the run's own parameters) or pass "
            "steps=qerl.rl.steps to create_pipeline",
        )


# ---------------------------------------------------------------- setup / start


def setup_quantized_policy(params: TrainParams, *, n_rounds: int) -> tuple[Policy, pd.DataFrame]:
    """Validate all settings, then load the base quantized layer by layer and attach LoRA."""
    validate_train_params(params, n_rounds)
    policy, report = build_policy(policy_spec(params))
    table = pd.DataFrame(report)
    log.info(
        "policy ready: %s, %s, %d LoRA params",
        params.quant.format, policy.device, sum(p.numel() for p in policy.lora_parameters()),
    )
    return policy, table


def start_training(policy: Policy, baseline_eval: pd.DataFrame, params: TrainParams) -> TrainState:
    """A fresh training state, or the newest checkpoint of this same run (``rl.resume: auto``)."""
    del baseline_eval  # ordering only: the baseline is measured before any update
    rl = params.rl
    return train_run.start_run(
        policy,
        run_name=rl.run_name, fingerprint=run_fingerprint(params), total_steps=rl.steps, save_every=rl.save_every,
        optimizer=rl.optimizer, lr=rl.lr, weight_decay=rl.weight_decay, warmup_ratio=rl.warmup_ratio,
        lr_schedule=rl.lr_schedule, optimizer_steps_per_step=rl.epochs * rl.minibatches,
        noise=build_schedule(noise_config(params), rl.steps), checkpoint_root=CHECKPOINT_ROOT, resume=rl.resume,
    )


# ---------------------------------------------------------------- the three per-step stages


def generate_rollouts(
    policy: Policy, state: TrainState, train_prompts: pd.DataFrame, params: TrainParams, *, step: int
) -> pd.DataFrame:
    """Sample G completions per prompt of this step with the 4-bit policy, its live adapter and AQN."""
    if state.resident and state.step >= step:
        return SKIPPED  # resumed run: this step is already in the checkpoint
    if not state.resident:
        log.info("rollouts of step %d from checkpoint %s", step, state.checkpoint_dir)
    train_run.sync_policy(policy, state)
    noise = _noise(state, params)
    sigma = noise.sigma(step - 1)
    prompts = select_prompts(train_prompts, step, params.rl.prompts_per_step, params.rl.seed)
    engine = get_engine(params.rollout.engine, policy.device)
    return rollout_step(policy, prompts, step, sigma, rollout_config(params), engine, params.rl.seed)


def score_rewards(rollouts: pd.DataFrame, params: TrainParams) -> pd.DataFrame:
    """Reward every completion (weighted reward functions) and compute group advantages."""
    if is_skipped(rollouts):
        return SKIPPED
    fns = build_rewards([r.model_dump() for r in params.rewards.functions], "qerl.rewards.functions")
    return score_step(
        rollouts, fns, params.rollout.group_size, scale_by_std=params.rl.scale_by_std,
        dynamic_sampling=params.rl.dynamic_sampling, on_error=params.rewards.on_error,
    )


def lora_rl_update(policy: Policy, state: TrainState, scored: pd.DataFrame, params: TrainParams) -> TrainState:
    """PPO-clipped LoRA update on the scored rollouts; records metrics and checkpoints when due."""
    if is_skipped(scored):
        return state
    if not state.resident:
        raise QerlConfigError(
            "lora_rl_update", "cannot update from a checkpoint alone (no optimizer in memory)",
            "rerun training with `kedro run --pipeline=qerl_train` (it resumes from the latest checkpoint)",
        )
    cfg = UpdateConfig(
        objective=objective_config(params), epochs=params.rl.epochs, minibatches=params.rl.minibatches,
        max_grad_norm=params.rl.max_grad_norm, track_kl=params.rl.track_kl, max_bad_steps=params.rl.max_bad_steps,
        seed=params.rl.seed,
    )
    metrics = update_step(policy, state, scored, cfg, params.rollout.temperature)
    train_run.finish_step(policy, state, metrics, CHECKPOINT_ROOT)
    return state


def bind(func: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """``func`` with keyword arguments bound (e.g. its step number), keeping the name, docstring
    and annotations Kedro, its parameter validation and kedro viz read."""
    bound = functools.partial(func, **kwargs)
    functools.update_wrapper(bound, func)
    return bound


# ---------------------------------------------------------------- after training


def collect_metrics(state: TrainState) -> pd.DataFrame:
    """The per-step metrics table of the run (each step once, also across a resume)."""
    if not state.history:
        raise QerlConfigError("qerl.rl.steps", "the run recorded no steps", "run at least one step")
    df = pd.DataFrame(state.history).drop_duplicates("step", keep="last").sort_values("step")
    df.insert(0, "run", f"{state.run_name}/{state.fingerprint}")
    return df.reset_index(drop=True)


def _noise(state: TrainState, params: TrainParams) -> Any:
    if state.noise is not None and hasattr(state.noise, "sigma"):
        return state.noise
    noise = build_schedule(noise_config(params), params.rl.steps)
    if isinstance(state.noise, dict) and hasattr(noise, "load_state_dict"):
        noise.load_state_dict(state.noise)
    return noise


def evaluate(policy: Policy, state: TrainState | None, eval_prompts: pd.DataFrame, params: TrainParams, *, stage: str) -> pd.DataFrame:
    """Greedy pass@1 and sampled pass@k on held-out prompts, adapter applied."""
    from qerl.eval.evaluate import evaluate_policy

    if state is not None:
        train_run.sync_policy(policy, state)
    e = params.eval
    prompts = eval_prompts if e.max_prompts is None else eval_prompts.head(e.max_prompts)
    summary, _ = evaluate_policy(
        policy, prompts, get_engine(params.rollout.engine, policy.device), k=e.k, temperature=e.temperature,
        max_new_tokens=e.max_new_tokens, max_prompt_tokens=params.rollout.max_prompt_tokens,
        reward=dict(e.correctness), threshold=e.threshold, seed=e.seed,
    )
    row = {"stage": stage, "step": state.step if state is not None else 0, "format": params.quant.format, **summary}
    log.info("evaluation (%s): %s", stage, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    return pd.DataFrame([row])


def evaluate_before(policy: Policy, eval_prompts: pd.DataFrame, params: TrainParams) -> pd.DataFrame:
    """Baseline: the quantized warm start with the fresh (zero) adapter."""
    return evaluate(policy, None, eval_prompts, params, stage="before")


def evaluate_after(policy: Policy, state: TrainState, eval_prompts: pd.DataFrame, params: TrainParams) -> pd.DataFrame:
    """The trained policy."""
    return evaluate(policy, state, eval_prompts, params, stage="after")


def collect_evaluation(before: pd.DataFrame, after: pd.DataFrame) -> pd.DataFrame:
    """Before and after side by side (one row each) plus the gain."""
    table = pd.concat([before, after], ignore_index=True)
    gain = after.iloc[0]["pass@1_greedy"] - before.iloc[0]["pass@1_greedy"]
    log.info("held-out greedy pass@1: %.3f -> %.3f (%+.1f points)", before.iloc[0]["pass@1_greedy"], after.iloc[0]["pass@1_greedy"], 100 * gain)
    return table


def report_noise_metrics(policy: Policy, state: TrainState, eval_prompts: pd.DataFrame, params: TrainParams) -> pd.DataFrame:
    """KL(full precision || quantized), entropies and entropy gain on a fixed probe set, per format."""
    from qerl.eval.noise_report import noise_report

    train_run.sync_policy(policy, state)
    probe = eval_prompts["prompt"].head(params.report.probe_size).tolist()
    sigma = params.noise.sigma_start if params.noise.enabled else 0.0
    table = noise_report(policy, probe, list(params.report.formats), sigma, params.report.max_new_tokens, params.rl.seed)
    table.insert(0, "step", state.step)
    return table


def plot_training(metrics: pd.DataFrame) -> dict[str, Any]:
    """Reward, entropy, sigma and KL over steps (PNG per curve + overview)."""
    from qerl.eval.plots import training_figures

    return training_figures(metrics)
