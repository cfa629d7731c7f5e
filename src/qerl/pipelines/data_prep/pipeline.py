"""``data_prep``: prompt sources -> versioned train / eval prompt tables."""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from .nodes import prepare_prompts


def create_pipeline(**kwargs: object) -> Pipeline:
    return Pipeline(
        [Node(prepare_prompts, "params:data", ["train_prompts", "eval_prompts"], name="prepare_prompts")],
        tags=["data_prep"],
    )
