"""Project pipelines: every folder under ``qerl/pipelines`` with a ``create_pipeline``."""

from __future__ import annotations

from kedro.framework.project import find_pipelines
from kedro.pipeline import Pipeline


def register_pipelines() -> dict[str, Pipeline]:
    """Register the project's pipelines; ``__default__`` is the full training run."""
    pipelines = find_pipelines(raise_errors=True)
    if "qerl_train" in pipelines:  # kedro loads only the requested pipelines (1.5+)
        pipelines["__default__"] = pipelines["qerl_train"]
    return pipelines
