"""AQN noise schedules: the standard deviation ``sigma`` of the noise added at each training step.

Every schedule implements the small ``NoiseSchedule`` interface:

- ``sigma(step) -> float``: the noise level for the rollouts of ``step`` (0-based);
- ``observe(step, entropy)``: feedback after the step (a no-op for fixed schedules; the
  entropy-feedback controller of ``qerl.noise.controller`` uses it);
- ``state_dict()`` / ``load_state_dict()``: what a checkpoint must keep to resume exactly.

Fixed schedules (paper section 3.3): training is split into ``K`` equal stages over
``total_steps``, ``stage = min(floor(step * K / total_steps), K - 1)``. Stage 0 adds no noise (the
quantization noise alone); stages ``k = 1 .. K-1`` interpolate from ``sigma_start`` (k = 1) to
``sigma_end`` (k = K-1) along ``t = (k - 1) / (K - 2)`` in [0, 1] with one of the shapes:

- ``exponential`` (paper default): ``sigma_start * (sigma_end / sigma_start) ** t`` (geometric;
  needs both sigmas > 0);
- ``linear``: ``sigma_start + (sigma_end - sigma_start) * t``;
- ``cosine``: ``sigma_end + (sigma_start - sigma_end) * (1 + cos(pi * t)) / 2`` (slow at both ends);
- ``logarithmic``: ``sigma_start + (sigma_end - sigma_start) * ln(1 + (e - 1) * t)`` (fast early
  decay that flattens out; ``ln(1 + (e - 1) t)`` runs from 0 to 1);
- ``constant``: ``sigma_start`` for every noisy stage (still noise-free in stage 0).

and ``none``: always 0. With ``K = 2`` there is a single noisy stage; it uses ``sigma_start``
(``t = 0``), so ``sigma_end`` is never reached. Pure python; no Kedro.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from qerl.errors import QerlConfigError
from qerl.noise.controller import EntropyFeedbackController

if TYPE_CHECKING:
    from qerl.params import NoiseParams

SHAPES: tuple[str, ...] = ("exponential", "linear", "cosine", "logarithmic", "constant")
"""Interpolation shapes of the staged schedule."""

FIXED_SCHEDULES: tuple[str, ...] = ("none", *SHAPES)
"""Every ``noise.schedule`` value that does not depend on feedback."""

SCHEDULES: tuple[str, ...] = (*FIXED_SCHEDULES, "entropy_feedback")
"""Every valid ``noise.schedule`` value."""


@runtime_checkable
class NoiseSchedule(Protocol):
    """What the trainer needs from a noise schedule."""

    def sigma(self, step: int) -> float:
        """Noise standard deviation to use for the rollouts of ``step``."""
        ...

    def observe(self, step: int, entropy: float) -> None:
        """Feed back the policy entropy measured at ``step`` (fixed schedules ignore it)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Plain-python state to checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the state returned by ``state_dict``."""
        ...


def _check_sigma(field: str, value: float) -> None:
    """Raise unless ``value`` is a finite number >= 0."""
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise QerlConfigError(field, f"must be a finite number >= 0, got {value!r}",
                              "use the paper's values, e.g. sigma_start 1e-2, sigma_end 5e-4")


def interpolate(shape: str, t: float, sigma_start: float, sigma_end: float) -> float:
    """Sigma at fraction ``t`` in [0, 1] of the noisy phase for one of ``SHAPES`` (module doc)."""
    t = min(max(t, 0.0), 1.0)
    if shape == "exponential":
        if sigma_start == sigma_end:
            return float(sigma_start)
        return float(sigma_start * (sigma_end / sigma_start) ** t)
    if shape == "linear":
        return float(sigma_start + (sigma_end - sigma_start) * t)
    if shape == "cosine":
        return float(sigma_end + (sigma_start - sigma_end) * 0.5 * (1.0 + math.cos(math.pi * t)))
    if shape == "logarithmic":
        return float(sigma_start + (sigma_end - sigma_start) * math.log1p((math.e - 1.0) * t))
    if shape == "constant":
        return float(sigma_start)
    raise QerlConfigError("noise.schedule", f"unknown shape {shape!r}",
                          f"use one of {', '.join(SCHEDULES)}")


class StagedSchedule:
    """The paper's K-stage schedule (stage 0 noise-free, then ``shape`` from start to end).

    Args:
        shape: one of ``SHAPES``.
        sigma_start: sigma of stage 1.
        sigma_end: sigma of stage K-1.
        stages: K >= 2.
        total_steps: number of training steps the stages divide, >= 1.
    """

    def __init__(self, shape: str, sigma_start: float, sigma_end: float, stages: int,
                 total_steps: int) -> None:
        if shape not in SHAPES:
            raise QerlConfigError("noise.schedule", f"unknown shape {shape!r}",
                                  f"use one of {', '.join(SCHEDULES)}")
        _check_sigma("noise.sigma_start", sigma_start)
        _check_sigma("noise.sigma_end", sigma_end)
        if shape == "exponential" and sigma_start != sigma_end and min(sigma_start, sigma_end) <= 0:
            raise QerlConfigError("noise.sigma_end" if sigma_end <= 0 else "noise.sigma_start",
                                  "must be > 0 for the exponential (geometric) schedule",
                                  "use a small positive value such as 1e-4, or schedule 'linear'")
        if not isinstance(stages, int) or stages < 2:
            raise QerlConfigError("noise.stages", f"must be an integer >= 2, got {stages!r}",
                                  "use the paper's K = 10 (stage 0 is noise-free)")
        if not isinstance(total_steps, int) or total_steps < 1:
            raise QerlConfigError("rl.total_steps", f"must be an integer >= 1, got {total_steps!r}",
                                  "set the number of training steps")
        self.shape = shape
        self.sigma_start = float(sigma_start)
        self.sigma_end = float(sigma_end)
        self.stages = stages
        self.total_steps = total_steps

    def stage(self, step: int) -> int:
        """``min(floor(step * K / total_steps), K - 1)``; steps past the end stay in the last stage."""
        if step < 0:
            raise QerlConfigError("step", f"must be >= 0, got {step}", "count steps from 0")
        return min(step * self.stages // self.total_steps, self.stages - 1)

    def sigma_of_stage(self, k: int) -> float:
        """Sigma of stage ``k``: 0 for k = 0, else the shape at ``t = (k - 1) / (K - 2)``."""
        if k <= 0:
            return 0.0
        t = 0.0 if self.stages == 2 else (k - 1) / (self.stages - 2)
        return interpolate(self.shape, t, self.sigma_start, self.sigma_end)

    def sigma(self, step: int) -> float:
        """Noise standard deviation for the rollouts of ``step``."""
        return self.sigma_of_stage(self.stage(step))

    def observe(self, step: int, entropy: float) -> None:
        """Fixed schedule: feedback is ignored."""

    def state_dict(self) -> dict[str, Any]:
        """Stateless; returns its parameters so a checkpoint records what was used."""
        return {"kind": "staged", "shape": self.shape, "sigma_start": self.sigma_start,
                "sigma_end": self.sigma_end, "stages": self.stages,
                "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore (the schedule is a pure function of the step)."""

    def __repr__(self) -> str:
        return (f"StagedSchedule(shape={self.shape!r}, sigma_start={self.sigma_start}, "
                f"sigma_end={self.sigma_end}, stages={self.stages}, "
                f"total_steps={self.total_steps})")


class NoNoise:
    """``noise.schedule: none`` (or noise disabled): sigma is always 0."""

    def sigma(self, step: int) -> float:
        """Always 0."""
        return 0.0

    def observe(self, step: int, entropy: float) -> None:
        """Ignored."""

    def state_dict(self) -> dict[str, Any]:
        """Stateless."""
        return {"kind": "none"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""

    def __repr__(self) -> str:
        return "NoNoise()"


def build_schedule(cfg: NoiseParams, total_steps: int) -> NoiseSchedule:
    """The schedule ``cfg`` (``qerl.params.NoiseParams``) describes, over ``total_steps`` training steps.

    ``none`` or ``enabled: false`` -> ``NoNoise``; a shape of ``SHAPES`` -> ``StagedSchedule``;
    ``entropy_feedback`` -> ``EntropyFeedbackController`` starting at ``sigma_start``.
    """
    if cfg.schedule not in SCHEDULES:
        raise QerlConfigError("noise.schedule", f"unknown schedule {cfg.schedule!r}",
                              f"use one of {', '.join(SCHEDULES)}")
    if not cfg.enabled or cfg.schedule == "none":
        return NoNoise()
    if cfg.schedule == "entropy_feedback":
        return EntropyFeedbackController(cfg.sigma_start, cfg.controller)
    return StagedSchedule(cfg.schedule, cfg.sigma_start, cfg.sigma_end, cfg.stages, total_steps)
