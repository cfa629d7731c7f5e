"""``quant_study`` nodes: train the same task with the same seeds and step budget once per
(variant, seed), then compare. Each run executes the very node functions of ``qerl_train``
(rollouts -> rewards -> update) in a loop, in process, so the study measures the production code.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from qerl.eval.noise_report import noise_report
from qerl.noise.param_noise import add_matched_weight_noise_
from qerl.params import TrainParams
from qerl.pipelines.qerl_train import nodes as train_nodes
from qerl.study.summary import curves_figure, final_accuracy_figure, per_run_rows, summary_table
from qerl.train.policy import build_policy

log = logging.getLogger(__name__)


class VariantParams(BaseModel):
    """One arm of the study: a format, a noise schedule, a learning-rate multiplier."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str
    format: str = "nvfp4"
    noise: str = "none"  # a qerl noise.schedule value
    lr_scale: float = 1.0
    param_noise: str | None = None  # match this 4-bit format's error with static Gaussian noise


class StudyParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    seeds: list[int] = Field(default_factory=lambda: [0, 1, 2])
    steps: int = 40
    reward_threshold: float = 1.0
    probe_size: int = 16
    eval_max_prompts: int | None = 100
    eval_k: int = 4
    variants: list[VariantParams]


def variant_params(base: TrainParams, study: StudyParams, variant: VariantParams, seed: int) -> TrainParams:
    """The ``qerl`` block of one run: same everything, the variant's format/noise/lr, the seed."""
    raw = base.model_dump()
    raw["quant"]["format"] = variant.format
    raw["noise"]["enabled"] = variant.noise != "none"
    raw["noise"]["schedule"] = variant.noise if variant.noise != "none" else raw["noise"]["schedule"]
    raw["rl"].update(
        lr=base.rl.lr * variant.lr_scale, seed=seed, steps=study.steps, run_name=f"study_{variant.name}_s{seed}",
        resume="never", save_every=study.steps,
    )
    raw["eval"].update(max_prompts=study.eval_max_prompts, k=study.eval_k)
    return TrainParams(**raw)


def run_variant(
    train_prompts: pd.DataFrame, eval_prompts: pd.DataFrame, qerl: TrainParams, study: StudyParams, *, variant: str, seed: int
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Train one (variant, seed); returns its per-step metrics and its before/after evaluation."""
    v = next(x for x in study.variants if x.name == variant)
    p = variant_params(qerl, study, v, seed)
    train_nodes.validate_train_params(p)
    t0 = time.perf_counter()
    policy, _ = build_policy(train_nodes.policy_spec(p))
    if v.param_noise:
        add_matched_weight_noise_(policy.model, v.param_noise, seed=seed)
    before = train_nodes.evaluate_before(policy, eval_prompts, p)
    state = train_nodes.start_training(policy, before, p)
    for k in range(1, p.rl.steps + 1):
        rollouts = train_nodes.generate_rollouts(policy, state, train_prompts, p, step=k)
        scored = train_nodes.score_rewards(rollouts, p)
        state = train_nodes.lora_rl_update(policy, state, scored, p)
    after = train_nodes.evaluate_after(policy, state, eval_prompts, p)
    probe = eval_prompts["prompt"].head(study.probe_size).tolist()
    noise = noise_report(policy, probe, [], 0.0, p.report.max_new_tokens, seed)
    kl_base = float(noise.loc[noise["variant"] == "quantized base", "kl"].iloc[0])
    evaluation = pd.concat([before, after], ignore_index=True).assign(variant=variant, seed=seed, kl_base_to_fp=kl_base)
    metrics = train_nodes.collect_metrics(state).assign(variant=variant, seed=seed)
    log.info(
        "study %s seed %d: pass@1 %.3f -> %.3f in %.0f s", variant, seed,
        before["pass@1_greedy"].iloc[0], after["pass@1_greedy"].iloc[0], time.perf_counter() - t0,
    )
    return metrics, evaluation


def summarize_study(study: StudyParams, *runs: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """All runs' metrics, the per-run table, the mean +- std summary and the plots."""
    metrics = pd.concat(runs[0::2], ignore_index=True)
    evaluation = pd.concat(runs[1::2], ignore_index=True)
    per_run = per_run_rows(metrics, evaluation, study.reward_threshold)
    summary = summary_table(per_run)
    log.info("quantization study:\n%s", summary.to_string(index=False))
    plots = {
        "reward.png": curves_figure(metrics, "reward_mean", "reward (mean over the batch)"),
        "entropy.png": curves_figure(metrics, "entropy", "rollout entropy (nats/token)"),
        "final_pass1.png": final_accuracy_figure(per_run),
    }
    return metrics, per_run, summary, plots
