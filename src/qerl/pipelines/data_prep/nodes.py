"""Prompt dataset prep: load every configured source, render the prompt template, split."""

from __future__ import annotations

import logging

import pandas as pd

from qerl.data.sources import build_prompt_tables
from qerl.params import DataParams

log = logging.getLogger(__name__)


def prepare_prompts(data: DataParams) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Train and eval prompt tables in the documented schema (``qerl.data.schema``)."""
    train, evaluation = build_prompt_tables(
        data.sources, data.template, data.system_prompt, eval_fraction=data.eval_fraction,
        eval_size=data.eval_size, seed=data.seed, max_prompts=data.max_prompts,
        max_prompt_chars=data.max_prompt_chars, prefix="data",
    )
    log.info("prompts: %d train, %d eval", len(train), len(evaluation))
    return train, evaluation
