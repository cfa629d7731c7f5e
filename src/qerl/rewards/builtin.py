"""Built-in reward functions (registered by name in :mod:`qerl.rewards.base`).

=================== ===========================================================================
name                value per completion
=================== ===========================================================================
``format``          ``reward`` (0.2, the paper's value) when the completion is exactly
                    ``<think>...</think>`` followed by ``<answer>...</answer>`` (whitespace
                    around / between the blocks allowed, one of each tag, non-blank answer),
                    else 0.
``exact_match``     ``reward`` (2.0, the paper's GSM8K value) when the extracted answer equals
                    the gold ``answer`` after :func:`qerl.data.schema.normalize_answer`, else 0;
                    ``None`` when the row has no gold answer.
``math_verify``     ``reward`` (1.0, the paper's BigMath value) when math-verify finds the
                    extracted answer equivalent to the gold ``answer``, else 0; ``None`` when the
                    gold answer cannot be parsed. Timeouts are off, so it works in any thread.
``reasoning_gym``   ``scale`` x reasoning-gym's own verifier score for the entry stored in
                    ``metadata`` (kept as is: countdown gives 0.01 for a wrong answer); ``None``
                    for rows that do not come from reasoning-gym.
``length_penalty``  ``-per_unit * max(0, length - target)`` (optionally capped at
                    ``-max_penalty``), the length in characters or in tokens taken from a
                    count column (``completion_tokens`` by default).
=================== ===========================================================================

Answers are taken from the last ``<answer>`` block by :func:`qerl.rewards.base.extract_answer`;
each reward's ``fallback`` option says what to use when there is none.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from qerl.data.schema import normalize_answer
from qerl.errors import QerlConfigError
from qerl.rewards.base import (
    RewardFn,
    check_fallback,
    column,
    completion_text,
    extract_answer,
    register_reward,
)

logger = logging.getLogger(__name__)

_FORMAT = re.compile(
    r"\s*<think>(?P<think>.*?)</think>\s*<answer>(?P<answer>.*?)</answer>\s*", re.DOTALL
)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def _check_number(value: Any, name: str, *, positive: bool = False) -> None:
    """Raise :class:`QerlConfigError` (field ``name``) unless ``value`` is a (positive) number."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise QerlConfigError(name, f"expected a number, got {value!r}", "give a number")
    if positive and value <= 0:
        raise QerlConfigError(name, f"must be > 0, got {value}", "give a positive number")


def _named(fn: RewardFn, name: str) -> RewardFn:
    """Give a reward function a readable ``__name__`` (TRL logs rewards by it)."""
    fn.__name__ = name
    fn.__qualname__ = name
    return fn


# --------------------------------------------------------------------------------------------
# format
# --------------------------------------------------------------------------------------------


def has_answer_format(text: str) -> bool:
    """True when ``text`` is ``<think>...</think>`` then ``<answer>...</answer>`` and nothing else."""
    m = _FORMAT.fullmatch(text)
    return bool(m and all(text.count(t) == 1 for t in _TAGS) and m.group("answer").strip() != "")


@register_reward("format")
def format_reward(reward: float = 0.2) -> RewardFn:
    """The paper's format reward: ``reward`` for a well-formed think/answer completion, else 0."""
    _check_number(reward, "reward")

    def fn(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        return [reward if has_answer_format(completion_text(c)) else 0.0 for c in completions]

    return _named(fn, "format")


# --------------------------------------------------------------------------------------------
# exact_match
# --------------------------------------------------------------------------------------------


def answers_match(predicted: str | None, gold: str, *, ignore_case: bool = False) -> bool:
    """True when two answers are equal after :func:`normalize_answer` (optionally caseless)."""
    if predicted is None:
        return False
    a, b = normalize_answer(predicted), normalize_answer(gold)
    return a.casefold() == b.casefold() if ignore_case else a == b


@register_reward("exact_match", requires=("answer",))
def exact_match_reward(
    reward: float = 2.0, fallback: str = "last_number", ignore_case: bool = False
) -> RewardFn:
    """``reward`` when the extracted answer equals the gold ``answer`` column after normalising."""
    _check_number(reward, "reward")
    check_fallback(fallback)

    def fn(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        golds = column(columns, "answer", "exact_match")
        out: list[float | None] = []
        for c, gold in zip(completions, golds, strict=True):
            if gold is None or not str(gold).strip():
                out.append(None)
                continue
            pred = extract_answer(completion_text(c), fallback)
            out.append(reward if answers_match(pred, str(gold), ignore_case=ignore_case) else 0.0)
        return out

    return _named(fn, "exact_match")


# --------------------------------------------------------------------------------------------
# math_verify
# --------------------------------------------------------------------------------------------


def _mv_parse(text: str) -> list[Any]:
    """math-verify ``parse`` with its (thread-unsafe) timeout turned off."""
    from math_verify import parse

    parsed = parse(text, parsing_timeout=None)
    if not parsed and "$" not in text:
        parsed = parse(f"${text}$", parsing_timeout=None)
    return parsed


@functools.lru_cache(maxsize=4096)
def _mv_parse_gold(gold: str) -> tuple[Any, ...]:
    """Parsed gold answer (cached: the same gold is scored once per sample of a group)."""
    return tuple(_mv_parse(gold))


def math_equivalent(predicted: str | None, gold: str) -> bool | None:
    """math-verify equivalence of two answers; ``None`` when the gold cannot be parsed.

    ``<answer>`` tags should already be stripped from ``predicted`` (see
    :func:`qerl.rewards.base.extract_answer`).
    """
    from math_verify import verify

    gold_parsed = _mv_parse_gold(gold)
    if not gold_parsed:
        return None
    if predicted is None:
        return False
    pred = _mv_parse(predicted)
    if not pred:
        return False
    return bool(verify(list(gold_parsed), pred, timeout_seconds=None))


@register_reward("math_verify", requires=("answer",))
def math_verify_reward(reward: float = 1.0, fallback: str = "full") -> RewardFn:
    """``reward`` when math-verify finds the extracted answer equivalent to the gold answer."""
    _check_number(reward, "reward")
    check_fallback(fallback)

    def fn(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        golds = column(columns, "answer", "math_verify")
        out: list[float | None] = []
        for c, gold in zip(completions, golds, strict=True):
            if gold is None or not str(gold).strip():
                out.append(None)
                continue
            ok = math_equivalent(extract_answer(completion_text(c), fallback), str(gold))
            out.append(None if ok is None else (reward if ok else 0.0))
        return out

    return _named(fn, "math_verify")


# --------------------------------------------------------------------------------------------
# reasoning_gym
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _rg_dataset(name: str, config_json: str, seed: int, size: int) -> Any:
    """The reasoning-gym dataset a row came from (cached; entries are generated lazily)."""
    import reasoning_gym

    return reasoning_gym.create_dataset(name, size=size, seed=seed, **json.loads(config_json))


@functools.lru_cache(maxsize=8192)
def _rg_entry(name: str, config_json: str, seed: int, size: int, index: int) -> dict[str, Any]:
    """The original entry, regenerated (JSON loses tuples some verifiers compare against)."""
    return _rg_dataset(name, config_json, seed, size)[index]


@functools.lru_cache(maxsize=128)
def _rg_default_scorer(source_dataset: str) -> Any:
    """reasoning-gym's scorer for a dataset name with its default config."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(source_dataset)


def _as_metadata(metadata: str | Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The metadata column value as a mapping (JSON string decoded)."""
    if metadata is None:
        return None
    if isinstance(metadata, str):
        if not metadata.strip():
            return None
        metadata = json.loads(metadata)
    return metadata if isinstance(metadata, Mapping) else None


def score_reasoning_gym(
    answer: str | None, metadata: str | Mapping[str, Any] | None
) -> float | None:
    """Score an answer with reasoning-gym's verifier for the entry stored in ``metadata``.

    The entry is regenerated from the stored generator parameters when possible (exactly the
    object the verifier was written for) and checked against the stored question; otherwise the
    stored JSON entry is scored by the task's default verifier. Returns ``None`` when the metadata
    holds no reasoning-gym entry.
    """
    meta = _as_metadata(metadata)
    if not meta or not isinstance(meta.get("entry"), Mapping):
        return None
    stored = dict(meta["entry"])
    gen = meta.get("reasoning_gym")
    if isinstance(gen, Mapping):
        key = json.dumps(gen.get("config", {}), sort_keys=True)
        entry = _rg_entry(gen["name"], key, int(gen["seed"]), int(gen["size"]), int(gen["index"]))
        if entry.get("question") == stored.get("question"):
            ds = _rg_dataset(gen["name"], key, int(gen["seed"]), int(gen["size"]))
            return float(ds.score_answer(answer, entry))
        logger.debug("reasoning-gym entry %s regenerated differently; using stored", gen)
    task = (stored.get("metadata") or {}).get("source_dataset") or (gen or {}).get("name")
    if not task:
        return None
    return float(_rg_default_scorer(task)(answer, stored))


@register_reward("reasoning_gym", requires=("metadata",))
def reasoning_gym_reward(scale: float = 1.0, fallback: str = "none") -> RewardFn:
    """``scale`` x reasoning-gym's verifier score of the extracted answer (None if not a rg row)."""
    _check_number(scale, "scale")
    check_fallback(fallback)

    def fn(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        metas = column(columns, "metadata", "reasoning_gym")
        out: list[float | None] = []
        for c, meta in zip(completions, metas, strict=True):
            score = score_reasoning_gym(extract_answer(completion_text(c), fallback), meta)
            out.append(None if score is None else scale * score)
        return out

    return _named(fn, "reasoning_gym")


# --------------------------------------------------------------------------------------------
# length_penalty
# --------------------------------------------------------------------------------------------

LENGTH_UNITS = ("chars", "tokens")


@register_reward("length_penalty")
def length_penalty_reward(
    target: int = 512,
    per_unit: float = 0.001,
    unit: str = "chars",
    count_column: str = "completion_tokens",
    max_penalty: float | None = None,
) -> RewardFn:
    """``-per_unit * max(0, length - target)``, capped at ``-max_penalty`` when set.

    ``unit="chars"`` measures the completion text; ``unit="tokens"`` reads the length from the
    ``count_column`` column (e.g. the rollout's completion token counts).
    """
    if isinstance(target, bool) or not isinstance(target, int) or target < 0:
        raise QerlConfigError("target", f"expected an integer >= 0, got {target!r}", "e.g. 512")
    _check_number(per_unit, "per_unit")
    if unit not in LENGTH_UNITS:
        raise QerlConfigError("unit", f"unknown unit {unit!r}", f"use one of {list(LENGTH_UNITS)}")
    if max_penalty is not None:
        _check_number(max_penalty, "max_penalty", positive=True)

    def fn(prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        if unit == "tokens":
            lengths = [float(n) for n in column(columns, count_column, "length_penalty")]
        else:
            lengths = [float(len(completion_text(c))) for c in completions]
        out: list[float | None] = []
        for length in lengths:
            penalty = per_unit * max(0.0, length - target)
            if max_penalty is not None:
                penalty = min(penalty, max_penalty)
            out.append(-penalty if penalty else 0.0)
        return out

    return _named(fn, "length_penalty")
