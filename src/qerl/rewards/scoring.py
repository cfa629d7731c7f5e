"""Batch scoring: run weighted reward functions over completions, isolating failing samples."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from qerl.errors import QerlConfigError
from qerl.rewards.base import ON_ERROR, RewardError, RewardFn, WeightedReward, completion_text

# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------


class ScoreResult(NamedTuple):
    """Output of :func:`score_completions`.

    Attributes:
        total: per sample, ``sum(weight * value)`` over functions (``None`` counts as 0).
        per_fn: per function, the weighted values (NaN where the function returned ``None``).
        n_errors: per function, how many samples raised (scored 0 under ``on_error="zero"``).
    """

    total: list[float]
    per_fn: dict[str, list[float]]
    n_errors: dict[str, int]


def _coerce(value: Any) -> float | None:
    """A reward value as float, ``None`` for not applicable (NaN counts as ``None``)."""
    if value is None:
        return None
    if (
        isinstance(value, str)
        or not isinstance(value, (int, float))
        and not hasattr(value, "__float__")
    ):
        raise TypeError(f"returned {value!r} ({type(value).__name__}), not a number or None")
    out = float(value)
    return None if math.isnan(out) else out


def _call_batch(
    fn: RewardFn, prompts: list[Any], completions: list[Any], cols: Mapping[str, list[Any]]
) -> list[float | None]:
    """Call ``fn`` on a batch and check the shape and types of its result."""
    values = fn(prompts=prompts, completions=completions, **cols)
    if values is None or isinstance(values, (str, bytes)) or len(values) != len(completions):
        got = "None" if values is None else f"{type(values).__name__} of length {len(values)}"
        raise TypeError(f"returned {got} for {len(completions)} completions")
    return [_coerce(v) for v in values]


def _excerpt(completion: Any, n: int = 60) -> str:
    """The first ``n`` characters of a completion, for error messages."""
    text = completion_text(completion)
    return text[:n] + ("..." if len(text) > n else "")


def score_completions(
    rewards: Sequence[WeightedReward | tuple[str, RewardFn, float]],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: Mapping[str, Sequence[Any]] | None = None,
    on_error: str = "raise",
) -> ScoreResult:
    """Score a batch of completions with weighted reward functions.

    Each function is first called on the whole batch. If that call raises or returns something
    unusable, it is called again one sample at a time to find the culprit(s): with
    ``on_error="raise"`` the first failing sample stops scoring with a :class:`RewardError`
    naming the function, the sample index and the start of the completion; with
    ``on_error="zero"`` failing samples score 0 and are counted in ``n_errors``.

    Args:
        rewards: ``(name, fn, weight)`` triples, e.g. from :func:`build_rewards`.
        prompts: one prompt per completion.
        completions: completion texts (or conversational completions).
        columns: prompt-table columns, each with one value per completion.
        on_error: ``"raise"`` or ``"zero"``.

    Returns:
        A :class:`ScoreResult` ``(total, per_fn, n_errors)``.
    """
    if on_error not in ON_ERROR:
        raise QerlConfigError(
            "on_error", f"unknown value {on_error!r}", f"use one of {list(ON_ERROR)}"
        )
    n = len(completions)
    prompt_list, completion_list = list(prompts), list(completions)
    cols = {k: list(v) for k, v in (columns or {}).items()}
    reserved = sorted({"prompts", "completions"} & set(cols))
    if reserved:
        raise QerlConfigError(
            f"columns.{reserved[0]}",
            "clashes with the reward functions' own argument",
            "rename the column (prompt-table columns are singular: prompt, answer, ...)",
        )
    for name, values in [("prompts", prompt_list), *cols.items()]:
        if len(values) != n:
            raise QerlConfigError(
                f"columns.{name}" if name != "prompts" else "prompts",
                f"has {len(values)} values for {n} completions",
                "repeat each prompt's columns once per completion",
            )
    total = [0.0] * n
    per_fn: dict[str, list[float]] = {}
    n_errors: dict[str, int] = {}
    for name, fn, weight in rewards:
        try:
            values = _call_batch(fn, prompt_list, completion_list, cols)
            errors = 0
        except Exception:
            values, errors = [], 0
            for i in range(n):
                one = {k: [v[i]] for k, v in cols.items()}
                try:
                    values.append(_call_batch(fn, [prompt_list[i]], [completion_list[i]], one)[0])
                except Exception as exc:
                    if on_error == "raise":
                        problem = f"{type(exc).__name__}: {exc}"
                        raise RewardError(name, i, _excerpt(completion_list[i]), problem) from exc
                    values.append(0.0)
                    errors += 1
        n_errors[name] = errors
        per_fn[name] = [math.nan if v is None else weight * v for v in values]
        for i, v in enumerate(values):
            if v is not None:
                total[i] += weight * v
    return ScoreResult(total, per_fn, n_errors)
