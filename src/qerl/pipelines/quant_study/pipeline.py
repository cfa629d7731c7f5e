"""``quant_study``: prompt prep -> every variant x seed trained by the core loop (``run_study``) ->
``summarize_study`` (versioned tables + plots). Variants and seeds: ``quant_study`` in the conf."""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from qerl.pipelines.data_prep import create_pipeline as data_prep_pipeline

from .nodes import run_study, summarize_study


def create_pipeline(**kwargs: object) -> Pipeline:
    return Pipeline(
        [
            data_prep_pipeline(),
            Node(run_study, ["train_prompts", "eval_prompts", "checkpoints", "params:qerl", "params:quant_study"],
                 ["study_metrics", "study_evaluation"], name="run_study"),
            Node(summarize_study, ["study_metrics", "study_evaluation", "params:quant_study"],
                 ["quant_study_metrics", "quant_study_runs", "quant_study_summary", "quant_study_plots"],
                 name="summarize_study"),
        ],
        tags=["quant_study"],
    )
