"""``qerl_train``: prompt prep -> quantized policy setup -> baseline -> the RL loop (``rl_loop``:
generate_rollouts -> score_rewards -> lora_rl_update, repeated rl.steps times by
``qerl.runner.LoopRunner``) -> noise report -> evaluation -> metrics, plots -> close_run.

The loop is one copy of the step in the DAG (kedro viz: one collapsible ``rl_loop`` group,
whatever rl.steps is); the policy and the training state are resident catalog entries, so nothing
is reloaded between steps. Each step's rollouts are saved by the ``rollouts`` entry (one file per
run and step).
"""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from qerl.pipelines.data_prep import create_pipeline as data_prep_pipeline
from qerl.runner import LOOP_TAG

from . import nodes as n

_Q = "params:qerl"


def rl_loop() -> Pipeline:
    """One RL step; the runner repeats it."""
    return Pipeline(
        [
            Node(n.generate_rollouts, ["policy", "train_state", "train_prompts", _Q, "params:replay"], "rollouts",
                 name="generate_rollouts"),
            Node(n.score_rewards, ["rollouts", f"{_Q}.rewards", f"{_Q}.rl"], "scored_rollouts", name="score_rewards"),
            Node(n.lora_rl_update, ["policy", "train_state", "scored_rollouts", f"{_Q}.rl", f"{_Q}.rollout"],
                 "trained_state", name="lora_rl_update"),
        ],
        namespace="rl_loop", prefix_datasets_with_namespace=False, tags=[LOOP_TAG],
    )


def create_pipeline(**kwargs: object) -> Pipeline:
    setup = Pipeline([
        Node(n.setup_quantized_policy, [f"{_Q}.model", f"{_Q}.quant", f"{_Q}.lora", f"{_Q}.rl"],
             ["policy", "quant_report"], name="setup_quantized_policy"),
        Node(n.evaluate_before, ["policy", "train_prompts", "eval_prompts", "checkpoints", _Q], "eval_before",
             name="evaluate_before"),
        Node(n.start_training, ["policy", "eval_before", "train_prompts", "checkpoints", _Q], "train_state",
             name="start_training"),
    ])
    report = Pipeline([
        Node(n.report_noise_metrics, ["policy", "trained_state", "eval_prompts", f"{_Q}.report", f"{_Q}.noise",
                                      f"{_Q}.rl"], "noise_metrics", name="report_noise_metrics"),
        Node(n.evaluate_after, ["policy", "trained_state", "eval_prompts", f"{_Q}.eval", f"{_Q}.rollout"], "eval_after",
             name="evaluate_after"),
        Node(n.collect_evaluation, ["eval_before", "eval_after"], "evaluation", name="collect_evaluation"),
        Node(n.collect_metrics, "trained_state", "training_metrics", name="collect_metrics"),
        Node(n.plot_training, ["training_metrics", "evaluation"], "training_plots", name="plot_training"),
        Node(n.close_run, ["trained_state", "evaluation", "training_metrics", "noise_metrics", "training_plots"], None,
             name="close_run"),
    ])
    return Pipeline([data_prep_pipeline(), setup, rl_loop(), report], tags=["qerl_train"])
