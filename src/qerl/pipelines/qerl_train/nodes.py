"""Nodes of ``qerl_train``: each one stage of the core (``qerl.train``), taking only the settings
blocks it uses. The RL step is ``generate_rollouts -> score_rewards -> lora_rl_update``, repeated by
``qerl.runner.LoopRunner``; a rollout node rerun alone replays one step of the configured run."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pandas as pd

from qerl.datasets.checkpoints import ReplayHandle
from qerl.errors import QerlConfigError
from qerl.eval.evaluate import evaluation_table
from qerl.params import (
    EvalParams,
    LoraParams,
    ModelParams,
    NoiseParams,
    QuantParams,
    ReplayParams,
    ReportParams,
    RewardParams,
    RLParams,
    RolloutParams,
)
from qerl.train import loop
from qerl.train.checkpoints import CheckpointStore
from qerl.train.policy import Policy, build_policy
from qerl.train.score import score_step
from qerl.train.seeds import derive_seed
from qerl.train.state import TrainState
from qerl.train.update import update_step
from qerl.validation import train_params

log = logging.getLogger(__name__)


def setup_quantized_policy(model: ModelParams, quant: QuantParams, lora: LoraParams, rl: RLParams) -> tuple[Policy, pd.DataFrame]:
    """Stage 2: load the base quantized layer by layer and attach a seeded LoRA adapter."""
    policy, report = build_policy(model, quant, lora, gradient_checkpointing=rl.gradient_checkpointing,
                                  seed=derive_seed(rl.seed, 0, "lora_init"))
    log.info("policy ready: %s on %s, %d LoRA parameters", quant.format, policy.device,
             sum(p.numel() for p in policy.lora_parameters()))
    return policy, pd.DataFrame(report)


def evaluate_before(policy: Policy, train_prompts: pd.DataFrame, eval_prompts: pd.DataFrame,
                    checkpoints: CheckpointStore, qerl: Mapping[str, Any]) -> pd.DataFrame:
    """Held-out baseline of the untrained (zero-adapter) policy; a resumed run reuses its own."""
    params = train_params(qerl)
    stored = checkpoints.run_for(params, train_prompts).eval_before()
    if stored is not None:
        log.info("held-out baseline: reusing the one this run measured before training")
        return stored
    return evaluation_table(policy, eval_prompts, params.eval, params.rollout, stage="before", step=0)


def start_training(policy: Policy, eval_before: pd.DataFrame, train_prompts: pd.DataFrame,
                   checkpoints: CheckpointStore, qerl: Mapping[str, Any]) -> TrainState:
    """A fresh run of this configuration, or its newest good checkpoint (``rl.resume: auto``)."""
    state = loop.start_run(policy, train_params(qerl), train_prompts, checkpoints)
    if state.run.eval_before() is None:
        state.run.save_eval_before(eval_before)
    return state


def generate_rollouts(policy: Policy, train_state: TrainState | ReplayHandle, train_prompts: pd.DataFrame,
                      qerl: Mapping[str, Any], replay: ReplayParams) -> pd.DataFrame:
    """Stage 3: G completions per prompt of the next step from the 4-bit policy with AQN noise.
    Rerun alone, it replays ``replay.step`` (default: the last) of this configuration's run (the
    whole ``qerl`` block identifies that run)."""
    params = train_params(qerl)
    if isinstance(train_state, ReplayHandle):
        train_state = loop.replay_state(policy, params, train_prompts, train_state.store, replay.step)
    return loop.generate(policy, train_state, train_prompts, params.rollout, params.rl)


def score_rewards(rollouts: pd.DataFrame, rewards: RewardParams, rl: RLParams) -> pd.DataFrame:
    """Stage 4: weighted reward functions, group-normalised advantages, DAPO's filter."""
    if rollouts["step"].nunique() != 1:
        raise QerlConfigError("score_rewards", f"got the rollouts of {rollouts['step'].nunique()} steps (the saved "
                              "training record); it scores one step", "replay it with its rollouts: "
                              "--nodes=rl_loop.generate_rollouts,rl_loop.score_rewards --params replay.step=N")
    return score_step(rollouts, rewards, rl)


def lora_rl_update(policy: Policy, train_state: TrainState | ReplayHandle, scored_rollouts: pd.DataFrame,
                   rl: RLParams, rollout: RolloutParams) -> TrainState:
    """Stage 5: the PPO-clipped LoRA update; records the step's metrics and checkpoints when due."""
    if isinstance(train_state, ReplayHandle) or not train_state.resident:
        raise QerlConfigError("lora_rl_update", "cannot update outside the training loop (no optimizer in memory)",
                              "run `kedro run --pipelines=qerl_train` (it resumes from the newest checkpoint)")
    row = update_step(policy, train_state, scored_rollouts, rl, rollout)
    loop.finish_step(policy, train_state, row)
    return train_state


def _live(state: TrainState | ReplayHandle, node: str) -> TrainState:
    if isinstance(state, ReplayHandle):
        raise QerlConfigError(node, "needs the live training state of this process",
                              "run the whole pipeline: `kedro run --pipelines=qerl_train` (a finished run is skipped)")
    return state


def report_noise_metrics(policy: Policy, trained_state: TrainState, eval_prompts: pd.DataFrame, report: ReportParams,
                         noise: NoiseParams, rl: RLParams) -> pd.DataFrame:
    """Stage 6: KL(full precision || quantized), entropies and entropy gain on a fixed probe set."""
    from qerl.eval.noise_report import noise_report

    state = _live(trained_state, "report_noise_metrics")
    probe = eval_prompts["prompt"].head(report.probe_size).tolist()
    sigma = noise.sigma_start if noise.enabled and noise.schedule != "none" else 0.0
    table = noise_report(policy, probe, list(report.formats), sigma, report.max_new_tokens, rl.seed)
    table.insert(0, "step", state.step)
    return table


def evaluate_after(policy: Policy, trained_state: TrainState, eval_prompts: pd.DataFrame, eval: EvalParams,
                   rollout: RolloutParams) -> pd.DataFrame:
    """Held-out evaluation of the trained policy, adapter applied."""
    state = _live(trained_state, "evaluate_after")
    return evaluation_table(policy, eval_prompts, eval, rollout, stage="after", step=state.step)


def collect_evaluation(eval_before: pd.DataFrame, eval_after: pd.DataFrame) -> pd.DataFrame:
    """Before and after, one row each."""
    return pd.concat([eval_before, eval_after], ignore_index=True)


def collect_metrics(trained_state: TrainState) -> pd.DataFrame:
    """The per-step metrics table of the run (each step once, also across a resume)."""
    return loop.metrics_table(_live(trained_state, "collect_metrics"))


def plot_training(training_metrics: pd.DataFrame, evaluation: pd.DataFrame) -> dict[str, Any]:
    """Reward, rollout entropy, sigma and KL over steps, and the held-out evaluation before/after."""
    from qerl.eval.plots import training_figures

    return training_figures(training_metrics, evaluation)


def close_run(trained_state: TrainState, evaluation: pd.DataFrame, training_metrics: pd.DataFrame,
              noise_metrics: pd.DataFrame, training_plots: dict[str, Any]) -> None:
    """Mark the run complete (a rerun of the same configuration is then skipped) and log the summary."""
    state = _live(trained_state, "close_run")
    before, after = (evaluation.set_index("stage").loc[s] for s in ("before", "after"))
    summary = {
        "steps": f"{state.step}/{state.total_steps}",
        "pass@1_greedy": [float(before["pass@1_greedy"]), float(after["pass@1_greedy"])],
        "outputs": "data/08_reporting (training_metrics, evaluation, noise_metrics, training_plots), "
                   f"data/07_model_output (rollouts), {state.run.path}",
    }
    state.run.mark_complete(summary)
    log.info("run %s finished: held-out greedy pass@1 %.3f -> %.3f (%+.1f points) over %s steps; outputs: %s",
             state.run.key, *summary["pass@1_greedy"], 100 * (summary["pass@1_greedy"][1] - summary["pass@1_greedy"][0]),
             summary["steps"], summary["outputs"])
    del training_metrics, noise_metrics, training_plots  # ordering only: complete once they are saved
