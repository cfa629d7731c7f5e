"""``embedded_model``: prompts -> SFT pairs of the selected task preset (held-out questions
excluded) -> tiny model trained from scratch until validation accuracy enters the band -> saved
with save_pretrained -> its held-out greedy accuracy."""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from qerl.pipelines.data_prep import create_pipeline as data_prep_pipeline

from .nodes import build_sft_set, measure_embedded_accuracy, train_embedded_model

PARAMS = ["params:embedded_model", "params:embedded_tasks"]


def create_pipeline(**kwargs: object) -> Pipeline:
    return Pipeline(
        [
            data_prep_pipeline(),
            Node(build_sft_set, ["eval_prompts", *PARAMS], "sft_set", name="build_sft_set"),
            Node(train_embedded_model, ["sft_set", *PARAMS], ["embedded_model", "sft_history"],
                 name="train_embedded_model"),
            Node(measure_embedded_accuracy, ["embedded_model", "eval_prompts", "sft_history", *PARAMS],
                 "embedded_model_accuracy", name="measure_embedded_accuracy"),
        ],
        tags=["embedded_model"],
    )
