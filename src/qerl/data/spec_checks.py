"""Checks of source specs that need more than types: the close-name hint, and a reasoning-gym task's
name and generator options checked against reasoning-gym itself (no data is made)."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping, Sequence
from typing import Any


class SpecProblem(ValueError):
    """A semantic problem found by a spec validator; ``sub`` is the field path inside the source."""

    def __init__(self, sub: str, problem: str, fix: str) -> None:
        self.sub, self.problem, self.fix = sub, problem, fix
        super().__init__(f"{sub}: {problem}. Fix: {fix}" if sub else f"{problem}. Fix: {fix}")


def close_names(word: str, choices: Sequence[str], n: int = 5) -> str:
    """'; close names: [...]' for ``word`` among ``choices`` (empty if nothing is close)."""
    close = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)
    return f"; close names: {close}" if close else ""


# --------------------------------------------------------------------------------- reasoning-gym


def _rg_registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's dataset registry: name -> (dataset class, config class)."""
    from reasoning_gym.factory import DATASETS

    return DATASETS


def check_reasoning_gym(name: str, size: int, seed: int, config: Mapping[str, Any]) -> None:
    """Check a task name and its generator options against reasoning-gym (no data is made).

    Raises:
        SpecProblem: unknown task (with close names), ``size`` / ``seed`` inside ``config``, an
            option the task's config class does not have, or options its ``validate`` rejects.
    """
    registry = _rg_registry()
    if name not in registry:
        raise SpecProblem(
            "name",
            f"unknown reasoning-gym task {name!r}{close_names(name, sorted(registry))}",
            f"use one of the {len(registry)} registered tasks "
            "(reasoning_gym.factory.DATASETS), e.g. basic_arithmetic, countdown, chain_sum",
        )
    clash = sorted({"size", "seed"} & set(config))
    if clash:
        raise SpecProblem(
            f"config.{clash[0]}",
            "set inside config; it belongs to the source itself",
            f"move {clash[0]} up one level, next to name",
        )
    config_cls = registry[name][1]
    allowed = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("size", "seed")]
    unknown = [k for k in config if k not in allowed]
    if unknown:
        raise SpecProblem(
            f"config.{unknown[0]}",
            f"not an option of reasoning-gym task {name!r}{close_names(unknown[0], allowed)}",
            f"use only {allowed}",
        )
    try:
        cfg = config_cls(**dict(config), size=size, seed=seed)
        if hasattr(cfg, "validate"):
            cfg.validate()
    except Exception as exc:  # config classes raise AssertionError / ValueError / TypeError
        raise SpecProblem(
            "config",
            f"rejected by reasoning-gym {name!r}: {type(exc).__name__}: {exc}",
            f"fix the generator options (allowed: {allowed})",
        ) from exc


