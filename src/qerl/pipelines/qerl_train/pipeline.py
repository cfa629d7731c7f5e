"""``qerl_train``: prompt prep -> quantized policy setup -> N unrolled RL steps
(generate_rollouts -> score_rewards -> lora_rl_update, one namespace ``step_NNNN`` each)
-> noise-metric report -> evaluation -> plots.

Why unrolled: Kedro pipelines are acyclic. Each RL step is its own namespace, so kedro viz shows
the six stages as nodes (steps collapse into namespaces), every step's rollouts are their own
versioned dataset, and any step's rollout node can be rerun alone
(``kedro run --nodes=step_0005.generate_rollouts``). The model is never reloaded between steps:
the policy and the training state are resident catalog entries (``PolicyDataset``,
``TrainStateDataset``). The number of steps is read from the conf files when the pipeline is built.
"""

from __future__ import annotations

from pathlib import Path

from kedro.pipeline import Node, Pipeline

from qerl.pipelines.data_prep import create_pipeline as data_prep_pipeline
from qerl.pipelines.registry_params import lookup

from . import nodes as n

DEFAULT_STEPS = 60


def configured_steps(project_path: Path | None = None) -> int:
    """``qerl.rl.steps`` of the current run (env + ``--params``), see ``registry_params``."""
    return int(lookup("qerl.rl.steps", DEFAULT_STEPS, project_path))


def step_name(k: int) -> str:
    return f"step_{k:04d}"


def one_step(k: int) -> Pipeline:
    """The three stages of RL step ``k`` (inputs: policy, state of step k-1, train prompts)."""
    return Pipeline(
        [
            Node(n.bind(n.generate_rollouts, step=k), ["policy", "state_in", "train_prompts", "params:qerl"],
                 "rollouts", name="generate_rollouts"),
            Node(n.score_rewards, ["rollouts", "params:qerl"], "scored_rollouts", name="score_rewards"),
            Node(n.lora_rl_update, ["policy", "state_in", "scored_rollouts", "params:qerl"], "state_out",
                 name="lora_rl_update"),
        ]
    )


def create_pipeline(**kwargs: object) -> Pipeline:
    steps = int(kwargs.get("steps") or configured_steps())
    setup = Pipeline(
        [
            Node(n.bind(n.setup_quantized_policy, n_rounds=steps), "params:qerl", ["policy", "quant_report"],
                 name="setup_quantized_policy"),
            Node(n.evaluate_before, ["policy", "eval_prompts", "params:qerl"], "eval_before", name="evaluate_before"),
            Node(n.start_training, ["policy", "eval_before", "params:qerl"], "state_step_0000", name="start_training"),
        ]
    )
    rounds = []
    for k in range(1, steps + 1):
        ns = step_name(k)
        rounds.append(
            Pipeline(
                one_step(k), namespace=ns,
                inputs={"policy": "policy", "state_in": f"state_{step_name(k - 1)}", "train_prompts": "train_prompts"},
                outputs={"state_out": f"state_{ns}"}, parameters={"params:qerl": "params:qerl"},
            )
        )
    final = f"state_{step_name(steps)}"
    report = Pipeline(
        [
            Node(n.report_noise_metrics, ["policy", final, "eval_prompts", "params:qerl"], "noise_metrics",
                 name="report_noise_metrics"),
            Node(n.evaluate_after, ["policy", final, "eval_prompts", "params:qerl"], "eval_after", name="evaluate_after"),
            Node(n.collect_evaluation, ["eval_before", "eval_after"], "evaluation", name="collect_evaluation"),
            Node(n.collect_metrics, final, "training_metrics", name="collect_metrics"),
            Node(n.plot_training, "training_metrics", "training_plots", name="plot_training"),
        ]
    )
    return Pipeline([data_prep_pipeline(), setup, *rounds, report], tags=["qerl_train"])
