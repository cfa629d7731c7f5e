"""Reward functions: the calling convention, a registry, answer extraction and batch scoring.

Calling convention (the one TRL's ``GRPOTrainer`` uses, so functions are interchangeable)::

    fn(prompts: list[str], completions: list[str], **columns) -> list[float | None]

``columns`` are the prompt-table columns (:mod:`qerl.data.schema`) repeated for each completion
(``answer``, ``task``, ``metadata``, ``id``, ... and any extra column such as a token count), each
a list as long as ``completions``. Functions must accept and ignore columns they do not use
(``**columns``). ``None`` in the result means "not applicable to this sample" (e.g. the
reasoning-gym verifier on a GSM8K row). A completion may also be a TRL conversational completion
(a list of ``{role, content}`` messages); :func:`completion_text` takes its last message.

Reward functions are built by name from parameters through the registry::

    rewards:
      - {name: format}                                  # 0.2 for <think>..</think><answer>..</answer>
      - {name: exact_match, weight: 1.0, kwargs: {reward: 2.0}}

:func:`score_completions` runs a list of weighted functions over a batch and returns the total
(``sum(weight * value)``, ``None`` counting as 0), the weighted per-function columns (``None`` kept
as NaN) and per-function error counts.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from qerl.errors import QerlConfigError

RewardFn = Callable[..., list[float | None]]
RewardFactory = Callable[..., RewardFn]

#: Answer fallbacks of :func:`extract_answer` when there is no ``<answer>`` block.
FALLBACKS: tuple[str, ...] = ("none", "last_number", "last_line", "full")
ON_ERROR: tuple[str, ...] = ("raise", "zero")

_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")

_REGISTRY: dict[str, RewardFactory] = {}
_REQUIRES: dict[str, tuple[str, ...]] = {}


class RewardError(RuntimeError):
    """A reward function raised or returned something unusable for one sample.

    Attributes:
        reward_name: the reward's name (its label in the per-function columns).
        index: index of the sample in the batch.
        excerpt: the start of the offending completion.
    """

    def __init__(self, reward_name: str, index: int, excerpt: str, problem: str) -> None:
        self.reward_name = reward_name
        self.index = index
        self.excerpt = excerpt
        super().__init__(
            f"reward function {reward_name!r} failed on sample {index} "
            f"(completion starts {excerpt!r}): {problem}"
        )


# --------------------------------------------------------------------------------------------
# Text helpers shared by every reward
# --------------------------------------------------------------------------------------------


def completion_text(completion: Any) -> str:
    """Plain text of a completion: a string, or the last message of a conversational one."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return str(completion.get("content", ""))
    if isinstance(completion, Sequence) and completion:
        return completion_text(completion[-1])
    return "" if completion is None else str(completion)


def extract_answer(text: str, fallback: str = "none") -> str | None:
    """The final answer in a completion.

    The content of the last complete ``<answer>...</answer>`` block, stripped (``None`` if it is
    blank). Without such a block, ``fallback`` decides: ``"none"`` -> ``None``; ``"last_number"``
    -> the last number in the text (commas kept; normalise before comparing); ``"last_line"`` ->
    the last non-blank line; ``"full"`` -> the whole text stripped.
    """
    text = completion_text(text)
    blocks = _ANSWER_BLOCK.findall(text)
    if blocks:
        return blocks[-1].strip() or None
    if fallback == "last_number":
        numbers = _NUMBER.findall(text)
        return numbers[-1].rstrip(",") if numbers else None
    if fallback == "last_line":
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return lines[-1] if lines else None
    if fallback == "full":
        return text.strip() or None
    return None


def check_fallback(fallback: str) -> None:
    """Raise :class:`QerlConfigError` (field ``fallback``) for an unknown fallback."""
    if fallback not in FALLBACKS:
        raise QerlConfigError(
            "fallback", f"unknown answer fallback {fallback!r}", f"use one of {list(FALLBACKS)}"
        )


def column(columns: Mapping[str, Any], name: str, reward: str) -> list[Any]:
    """A required column of the batch, with a clear error when it is missing."""
    if name not in columns:
        raise KeyError(
            f"{reward} needs the {name!r} column; got {sorted(columns)} "
            "(pass the prompt-table columns to the reward function)"
        )
    return list(columns[name])


# --------------------------------------------------------------------------------------------
# Registry and specs
# --------------------------------------------------------------------------------------------


def register_reward(name: str, requires: tuple[str, ...] = ()) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator registering a reward *factory* (kwargs -> reward function) under ``name``;
    ``requires`` names the prompt-table columns it reads (checked before any rollout)."""

    def deco(factory: RewardFactory) -> RewardFactory:
        _REGISTRY[name] = factory
        _REQUIRES[name] = tuple(requires)
        return factory

    return deco


def _registry() -> dict[str, RewardFactory]:
    """The registry (the package ``qerl.rewards`` registers the built-ins when imported)."""
    return _REGISTRY


def check_reward_columns(specs: Sequence[Mapping[str, Any]], columns: Sequence[str],
                         field_name: str = "qerl.rewards.functions") -> None:
    """Refuse, before any rollout, a reward function whose required prompt columns are missing."""
    have = set(columns)
    for i, raw in enumerate(specs):
        name = raw["name"] if isinstance(raw, Mapping) else str(raw)
        missing = [c for c in _REQUIRES.get(name, ()) if c not in have]
        if missing:
            raise QerlConfigError(
                f"{field_name}[{i}]", f"reward {name!r} reads the column(s) {missing}, which the training prompts "
                f"lack (columns: {sorted(have)})", "add them to the prompt source, or choose another reward")


def available_rewards() -> list[str]:
    """Names of every registered reward."""
    return sorted(_registry())


@dataclass(frozen=True)
class RewardSpec:
    """One entry of the ``rewards`` parameter list.

    Attributes:
        name: registered reward name (``format``, ``exact_match``, ``math_verify``,
            ``reasoning_gym``, ``length_penalty`` or a user registration).
        weight: multiplies the function's values in the total and the per-function columns.
        kwargs: options passed to the reward's factory.
        label: column name in the per-function results (default: ``name``); needed when the
            same reward is used twice.
    """

    name: str
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    label: str | None = None

    @property
    def key(self) -> str:
        """Name of this reward's per-function column."""
        return self.label or self.name


class WeightedReward(NamedTuple):
    """A built reward function with its column name and weight."""

    name: str
    fn: RewardFn
    weight: float


def parse_reward_spec(raw: Mapping[str, Any] | RewardSpec, field_name: str) -> RewardSpec:
    """Validate one ``rewards`` entry (a mapping or a :class:`RewardSpec`)."""
    if isinstance(raw, RewardSpec):
        spec = raw
    elif isinstance(raw, str):
        spec = RewardSpec(name=raw)
    elif isinstance(raw, Mapping):
        allowed = ["name", "weight", "kwargs", "label"]
        for key in raw:
            if key not in allowed:
                close = difflib.get_close_matches(str(key), allowed, n=2)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise QerlConfigError(
                    f"{field_name}.{key}",
                    f"not an option of a reward entry{hint}",
                    f"use only {allowed}; options of the function itself go under kwargs",
                )
        if "name" not in raw:
            raise QerlConfigError(
                f"{field_name}.name", "is required", f"use one of {available_rewards()}"
            )
        spec = RewardSpec(**dict(raw))
    else:
        raise QerlConfigError(
            field_name,
            f"expected a mapping, got {type(raw).__name__}",
            "give {name: ..., weight: ..., kwargs: {...}}",
        )
    if spec.name not in _registry():
        close = difflib.get_close_matches(str(spec.name), available_rewards(), n=3, cutoff=0.5)
        raise QerlConfigError(
            f"{field_name}.name",
            f"unknown reward {spec.name!r}" + (f"; close names: {close}" if close else ""),
            f"use one of {available_rewards()} or register one with register_reward",
        )
    w = spec.weight
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
        raise QerlConfigError(f"{field_name}.weight", f"expected a number, got {w!r}", "e.g. 1.0")
    if not isinstance(spec.kwargs, Mapping):
        raise QerlConfigError(
            f"{field_name}.kwargs",
            f"expected a mapping, got {type(spec.kwargs).__name__}",
            "give the function options as key: value pairs",
        )
    return spec


def build_reward(
    spec: Mapping[str, Any] | RewardSpec | str, field_name: str = "rewards[0]"
) -> WeightedReward:
    """Build one reward function from its spec (name, weight, kwargs).

    Raises:
        QerlConfigError: unknown name, bad weight, unknown kwarg or rejected kwarg value, naming
            ``<field_name>.name`` / ``.weight`` / ``.kwargs.<option>``.
    """
    spec = parse_reward_spec(spec, field_name)
    factory = _registry()[spec.name]
    params = inspect.signature(factory).parameters
    accepted = [p for p in params if params[p].kind is not inspect.Parameter.VAR_KEYWORD]
    for key in spec.kwargs:
        if key not in accepted:
            raise QerlConfigError(
                f"{field_name}.kwargs.{key}",
                f"not an option of reward {spec.name!r}",
                f"use only {accepted}",
            )
    try:
        inspect.signature(factory).bind(**dict(spec.kwargs))
    except TypeError as exc:
        raise QerlConfigError(f"{field_name}.kwargs", str(exc), f"options: {accepted}") from exc
    try:
        fn = factory(**dict(spec.kwargs))
    except QerlConfigError as exc:
        raise QerlConfigError(f"{field_name}.kwargs.{exc.field}", exc.problem, exc.fix) from exc
    return WeightedReward(spec.key, fn, float(spec.weight))


def build_rewards(
    specs: Sequence[Mapping[str, Any] | RewardSpec | str], field_name: str = "rewards"
) -> list[WeightedReward]:
    """Build every reward of the ``rewards`` parameter (all validated before returning)."""
    if isinstance(specs, (str, Mapping)) or not isinstance(specs, Sequence) or not specs:
        raise QerlConfigError(
            field_name,
            "expected a non-empty list of rewards",
            "e.g. [{name: format}, {name: exact_match}]",
        )
    built = [build_reward(s, f"{field_name}[{i}]") for i, s in enumerate(specs)]
    seen: dict[str, int] = {}
    for i, r in enumerate(built):
        if r.name in seen:
            raise QerlConfigError(
                f"{field_name}[{i}].label",
                f"reward column {r.name!r} already used by {field_name}[{seen[r.name]}]",
                "give one of them a distinct label",
            )
        seen[r.name] = i
    return built
