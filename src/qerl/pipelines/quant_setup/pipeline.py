"""``quant_setup``: the quantized LoRA policy in the configured format + a five-format comparison."""

from __future__ import annotations

from kedro.pipeline import Node, Pipeline

from .nodes import compare_formats, setup_policy

_BLOCKS = ["params:qerl.model", "params:qerl.quant", "params:qerl.lora"]


def create_pipeline(**kwargs: object) -> Pipeline:
    return Pipeline(
        [
            Node(setup_policy, _BLOCKS, ["policy", "quant_report"], name="setup_quantized_policy"),
            Node(compare_formats, _BLOCKS, "format_comparison", name="compare_formats"),
        ],
        tags=["quant_setup"],
    )
