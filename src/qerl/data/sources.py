"""Prompt tables from every configured source: load, render, filter, split.

:func:`build_prompt_tables` is the entry point the pipeline uses: it validates *all* source
parameters first (cheap, :func:`qerl.data.specs.parse_sources`), then loads each source, renders
the prompt template, filters and splits into train / eval tables. The parts live in their own
modules:

* :mod:`qerl.data.specs` -- the source specs (pydantic models, one per ``kind``) and their checks;
* :mod:`qerl.data.gym`, :mod:`qerl.data.files`, :mod:`qerl.data.hf` -- the three loaders;
* :mod:`qerl.data.rows` -- raw question/answer tables to prompt-table rows (input checks, GSM8K
  answers, ids, metadata);
* :mod:`qerl.data.split` -- the deterministic, task-stratified split.

The names below are re-exported so ``qerl.data.sources`` stays the one import for callers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from qerl.data.files import load_file
from qerl.data.gym import load_reasoning_gym
from qerl.data.hf import hf_offline, load_hf
from qerl.data.rows import default_id_prefix, parse_gold_answer, render_rows, to_json
from qerl.data.schema import (
    COL_ID,
    COL_PROMPT,
    PROMPT_COLUMNS,
    empty_prompt_table,
    validate_prompt_table,
)
from qerl.data.specs import (
    FileSource,
    HFSource,
    ReasoningGymSource,
    SourceModel,
    SourceSpec,
    parse_source,
    parse_sources,
)
from qerl.data.split import split_train_eval
from qerl.data.templates import PromptTemplate, get_template
from qerl.errors import QerlConfigError

__all__ = [
    "FileSource",
    "HFSource",
    "ReasoningGymSource",
    "SourceSpec",
    "build_prompt_tables",
    "default_id_prefix",
    "hf_offline",
    "load_file",
    "load_hf",
    "load_reasoning_gym",
    "load_source",
    "parse_gold_answer",
    "parse_source",
    "parse_sources",
    "render_rows",
    "split_train_eval",
    "to_json",
]

logger = logging.getLogger(__name__)


def load_source(
    spec: SourceModel | Mapping[str, Any],
    template: PromptTemplate | None = None,
    *,
    field_name: str = "data.sources[0]",
) -> pd.DataFrame:
    """Load any source kind as a prompt table (dispatch on ``kind``)."""
    parsed = parse_source(spec, field_name)
    if isinstance(parsed, ReasoningGymSource):
        return load_reasoning_gym(parsed, template, field_name=field_name)
    if isinstance(parsed, FileSource):
        return load_file(parsed, template, field_name=field_name)
    return load_hf(parsed, template, field_name=field_name)


def _check_int(value: Any, fld: str, minimum: int | None = None) -> None:
    """Raise unless ``value`` is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise QerlConfigError(fld, f"expected an integer, got {value!r}", "give a whole number")
    if minimum is not None and value < minimum:
        raise QerlConfigError(fld, f"must be >= {minimum}, got {value}", f"use {minimum} or more")


def _check_build_params(
    eval_fraction: float | None,
    eval_size: int | None,
    seed: int,
    max_prompts: int | None,
    max_prompt_chars: int | None,
    prefix: str,
) -> None:
    """Validate the scalar options of :func:`build_prompt_tables`."""
    if eval_fraction is not None and eval_size is not None:
        raise QerlConfigError(
            f"{prefix}.eval_size",
            "set together with eval_fraction",
            "set only one of eval_fraction and eval_size",
        )
    if eval_fraction is not None and (
        isinstance(eval_fraction, bool)
        or not isinstance(eval_fraction, (int, float))
        or not 0 <= eval_fraction < 1
    ):
        raise QerlConfigError(
            f"{prefix}.eval_fraction",
            f"must be a number in [0, 1), got {eval_fraction!r}",
            "use e.g. 0.1 for 10% of the prompts",
        )
    if eval_size is not None:
        _check_int(eval_size, f"{prefix}.eval_size", 0)
    _check_int(seed, f"{prefix}.seed")
    if max_prompts is not None:
        _check_int(max_prompts, f"{prefix}.max_prompts", 1)
    if max_prompt_chars is not None:
        _check_int(max_prompt_chars, f"{prefix}.max_prompt_chars", 1)


def _check_unique_ids(tables: Sequence[pd.DataFrame], prefix: str) -> None:
    """Raise if two sources produce the same id (same id_prefix)."""
    seen: dict[str, int] = {}
    for i, table in enumerate(tables):
        for row_id in table[COL_ID].tolist():
            j = seen.setdefault(row_id, i)
            if j != i:
                raise QerlConfigError(
                    f"{prefix}.sources[{i}].id_prefix",
                    f"id {row_id!r} is produced by sources[{j}] too (same id prefix)",
                    f"give {prefix}.sources[{i}] a distinct id_prefix (or remove the duplicate)",
                )


def _drop_long_prompts(
    df: pd.DataFrame, use: pd.Series, max_prompt_chars: int, prefix: str
) -> tuple[pd.DataFrame, pd.Series]:
    """Drop rows whose rendered prompt is longer than ``max_prompt_chars`` (count logged)."""
    keep = df[COL_PROMPT].str.len() <= max_prompt_chars
    if not keep.all():
        logger.warning(
            "%s.max_prompt_chars: dropped %d of %d prompts longer than %d characters",
            prefix,
            int((~keep).sum()),
            len(df),
            max_prompt_chars,
        )
    if not keep.any():
        raise QerlConfigError(
            f"{prefix}.max_prompt_chars",
            f"every prompt is longer than {max_prompt_chars} characters "
            f"(shortest: {int(df[COL_PROMPT].str.len().min())})",
            "raise max_prompt_chars or use a shorter template / system prompt",
        )
    return df[keep].reset_index(drop=True), use[keep].reset_index(drop=True)


def build_prompt_tables(
    sources: Sequence[Mapping[str, Any] | SourceModel],
    template: str | PromptTemplate = "qerl",
    system_prompt: str | None = None,
    *,
    eval_fraction: float | None = None,
    eval_size: int | None = None,
    seed: int = 0,
    max_prompts: int | None = None,
    max_prompt_chars: int | None = None,
    prefix: str = "data",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Load every source, render prompts, filter and split into ``(train_df, eval_df)``.

    Args:
        sources: ``data.sources`` (mappings or :mod:`qerl.data.specs` models); all are
            validated before anything is loaded.
        template: ``data.template`` (``"qerl"``, ``"plain"`` or a string with ``{question}``).
        system_prompt: ``data.system_prompt``; overrides the template's (``""`` for none).
        eval_fraction: share of the ``use: both`` rows held out (default 0.1 if neither is set).
        eval_size: exact number of held-out rows (instead of ``eval_fraction``).
        seed: split seed; same seed -> same split.
        max_prompts: cap on the number of *training* prompts (eval is drawn first, so the cap
            never changes the eval set).
        max_prompt_chars: drop rows whose rendered ``prompt`` is longer (count logged).
        prefix: parameter path of these options, used in error messages.

    Returns:
        Train and eval tables in the prompt-table schema, each ordered by a seeded shuffle.

    Raises:
        QerlConfigError: for any bad option or source, naming the parameter.
    """
    tmpl = get_template(
        template, system_prompt, field=f"{prefix}.template", system_field=f"{prefix}.system_prompt"
    )
    _check_build_params(eval_fraction, eval_size, seed, max_prompts, max_prompt_chars, prefix)
    specs = parse_sources(sources, f"{prefix}.sources")
    tables = [
        load_source(s, tmpl, field_name=f"{prefix}.sources[{i}]") for i, s in enumerate(specs)
    ]
    _check_unique_ids(tables, prefix)
    uses = [pd.Series([s.use] * len(t), dtype=object) for s, t in zip(specs, tables, strict=True)]
    df = pd.concat(tables, ignore_index=True)
    use = pd.concat(uses, ignore_index=True)
    if max_prompt_chars is not None:
        df, use = _drop_long_prompts(df, use, max_prompt_chars, prefix)
    pool = df[use == "both"].reset_index(drop=True)
    train, evals = empty_prompt_table(), empty_prompt_table()
    if len(pool):
        train, evals = split_train_eval(
            pool, eval_fraction=eval_fraction, eval_size=eval_size, seed=seed, prefix=prefix
        )
    extra_train = df[use == "train"]
    extra_eval = df[use == "eval"]
    if len(extra_train):
        train, _ = split_train_eval(pd.concat([train, extra_train]), eval_size=0, seed=seed)
    if len(extra_eval):
        evals, _ = split_train_eval(pd.concat([evals, extra_eval]), eval_size=0, seed=seed)
    if train.empty:
        raise QerlConfigError(
            f"{prefix}.sources",
            "no training prompts (every source has use: eval)",
            "add a source with use: both or use: train",
        )
    if max_prompts is not None and len(train) > max_prompts:
        logger.info(
            "%s.max_prompts: kept %d of %d training prompts", prefix, max_prompts, len(train)
        )
        train = train.head(max_prompts).reset_index(drop=True)
    logger.info("prompt tables: %d train, %d eval", len(train), len(evals))
    train = validate_prompt_table(train[list(PROMPT_COLUMNS)], f"{prefix}.train")
    evals = validate_prompt_table(evals[list(PROMPT_COLUMNS)], f"{prefix}.eval")
    return train, evals
