"""``quant_study`` nodes: train the same task with the same seeds and step budget once per
(variant, seed) through the core loop (``qerl.train.loop.train``, the one qerl_train runs), then
compare. Each run is its own checkpointed run (``study_<variant>_s<seed>``): a killed study resumes
the unfinished runs and skips the finished ones."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import pandas as pd

from qerl.eval.evaluate import evaluation_table
from qerl.eval.noise_report import noise_report
from qerl.noise.param_noise import add_matched_weight_noise_
from qerl.params import StudyParams, TrainParams, VariantParams
from qerl.study.summary import curves_figure, final_accuracy_figure, per_run_rows, summary_table
from qerl.train.checkpoints import CheckpointStore
from qerl.train.loop import metrics_table, train
from qerl.train.metrics import REWARD_MEAN, ROLLOUT_ENTROPY
from qerl.train.policy import build_policy_for
from qerl.validation import train_params

log = logging.getLogger(__name__)


def variant_params(base: TrainParams, study: StudyParams, variant: VariantParams, seed: int) -> TrainParams:
    """The ``qerl`` block of one run: same everything, the variant's format/noise/lr, the seed."""
    steps = study.steps or base.rl.steps
    noise = {"enabled": variant.noise != "none"}
    if variant.noise != "none":
        noise["schedule"] = variant.noise
    return base.with_updates(
        quant={"format": variant.format}, noise=noise,
        rl={"lr": base.rl.lr * variant.lr_scale, "seed": seed, "steps": steps, "resume": "auto",
            "run_name": f"study_{variant.name}_s{seed}", "save_every": steps, "adapter_every": steps, **variant.rl},
        eval={"max_prompts": study.eval_max_prompts, "k": study.eval_k},
    )


def run_variant(train_prompts: pd.DataFrame, eval_prompts: pd.DataFrame, checkpoints: CheckpointStore,
                qerl: TrainParams, study: StudyParams, variant: VariantParams, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Train one (variant, seed); returns its per-step metrics and its before/after evaluation."""
    p = variant_params(qerl, study, variant, seed)
    t0 = time.perf_counter()
    policy, _ = build_policy_for(p)
    if variant.param_noise:
        add_matched_weight_noise_(policy.model, variant.param_noise, seed=seed)
    before = evaluation_table(policy, eval_prompts, p.eval, p.rollout, stage="before", step=0)
    policy, state = train(p, train_prompts, checkpoint_root=str(checkpoints.root), policy=policy)
    after = evaluation_table(policy, eval_prompts, p.eval, p.rollout, stage="after", step=state.step)
    probe = eval_prompts["prompt"].head(study.probe_size).tolist()
    noise = noise_report(policy, probe, [], 0.0, p.report.max_new_tokens, seed)
    kl_base = float(noise.loc[noise["variant"] == "quantized base", "kl"].iloc[0])
    evaluation = pd.concat([before, after], ignore_index=True).assign(variant=variant.name, seed=seed, kl_base_to_fp=kl_base)
    metrics = metrics_table(state).assign(variant=variant.name, seed=seed)
    log.info("study %s seed %d: pass@1 %.3f -> %.3f in %.0f s", variant.name, seed,
             before["pass@1_greedy"].iloc[0], after["pass@1_greedy"].iloc[0], time.perf_counter() - t0)
    return metrics, evaluation


def run_study(train_prompts: pd.DataFrame, eval_prompts: pd.DataFrame, checkpoints: CheckpointStore,
              qerl: Mapping[str, Any], study: StudyParams) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Every variant x seed of the study (see :func:`run_variant`): all metrics, all evaluations."""
    base = train_params(qerl)
    metrics, evaluations = [], []
    for i, variant in enumerate(study.variants):
        for seed in study.seeds:
            log.info("study run %d/%d: %s seed %d", i * len(study.seeds) + study.seeds.index(seed) + 1,
                     len(study.variants) * len(study.seeds), variant.name, seed)
            m, e = run_variant(train_prompts, eval_prompts, checkpoints, base, study, variant, seed)
            metrics.append(m)
            evaluations.append(e)
    return pd.concat(metrics, ignore_index=True), pd.concat(evaluations, ignore_index=True)


def summarize_study(metrics: pd.DataFrame, evaluation: pd.DataFrame, study: StudyParams
                    ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """All runs' metrics, the per-run table, the mean +- std summary and the plots."""
    per_run = per_run_rows(metrics, evaluation, study.reward_threshold)
    summary = summary_table(per_run)
    log.info("quantization study:\n%s", summary.to_string(index=False))
    plots = {
        "reward.png": curves_figure(metrics, REWARD_MEAN, "reward (mean over the batch)"),
        "entropy.png": curves_figure(metrics, ROLLOUT_ENTROPY, "rollout entropy (nats/token)"),
        "final_pass1.png": final_accuracy_figure(per_run),
    }
    return metrics, per_run, summary, plots
