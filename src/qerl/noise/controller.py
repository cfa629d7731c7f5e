"""The seed's entropy-feedback noise controller, as a ``NoiseSchedule``.

The seed's idea: keep raising the noise while exploration (policy entropy, or the entropy gain over
full precision) keeps improving, and back off as soon as it stops. Here:

- observations are smoothed by a moving average over the last ``window`` values;
- "improving" means the moving average beats the best moving average seen so far by more than
  ``tolerance``; the best is then updated;
- the first observation only sets the baseline (there is nothing to compare it to);
- changes are **multiplicative**: ``sigma *= up`` on improvement, ``sigma *= down`` otherwise, then
  clamped to ``[sigma_min, sigma_max]``. The seed stepped additively (+0.05 / -0.02 on a 0.1..1
  scale); AQN sigmas span orders of magnitude (1e-2 .. 1e-4), where a fixed additive step is either
  negligible or overshoots, so steps are relative. Like the seed, the default raises faster than it
  lowers (``up = 1.2``, ``down = 0.9``).

Because RL entropy usually falls as the policy sharpens, the controller mostly decays sigma after an
initial phase, behaving like an adaptive version of the paper's decaying schedule.
Pure python; no Kedro.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

from qerl.errors import QerlConfigError

if TYPE_CHECKING:
    from qerl.params import ControllerParams


class EntropyFeedbackController:
    """Entropy-driven sigma (see module doc). Implements ``NoiseSchedule``.

    Args:
        sigma_init: starting sigma, clamped into ``[sigma_min, sigma_max]``.
        cfg: bounds and gains (``noise.controller``, validated by the settings model).
    """

    def __init__(self, sigma_init: float, cfg: ControllerParams) -> None:
        self.cfg = cfg
        if not isinstance(sigma_init, (int, float)) or not math.isfinite(sigma_init) \
                or sigma_init < 0:
            raise QerlConfigError("noise.sigma_start", f"must be a finite number >= 0, got "
                                  f"{sigma_init!r}", "use e.g. 1e-2")
        self._sigma = self._clamp(float(sigma_init))
        self.best_entropy: float | None = None
        self.history: deque[float] = deque(maxlen=self.cfg.window)
        self.num_updates = 0

    def _clamp(self, sigma: float) -> float:
        return min(max(sigma, self.cfg.sigma_min), self.cfg.sigma_max)

    @property
    def current_sigma(self) -> float:
        """The sigma the next rollouts will use."""
        return self._sigma

    def update(self, entropy: float) -> float:
        """Record one entropy observation and return the new sigma.

        Raises ``QerlConfigError`` on a non-finite entropy (a diverged run should stop, not silently
        steer the noise).
        """
        if not isinstance(entropy, (int, float)) or not math.isfinite(entropy):
            raise QerlConfigError("entropy", f"must be a finite number, got {entropy!r}",
                                  "check the run for divergence (nan/inf log-probs)")
        self.history.append(float(entropy))
        average = sum(self.history) / len(self.history)
        self.num_updates += 1
        if self.best_entropy is None:
            self.best_entropy = average  # baseline: nothing to compare with yet
        elif average > self.best_entropy + self.cfg.tolerance:
            self.best_entropy = average
            self._sigma = self._clamp(self._sigma * self.cfg.up)
        else:
            self._sigma = self._clamp(self._sigma * self.cfg.down)
        return self._sigma

    # NoiseSchedule interface ----------------------------------------------------------------------

    def sigma(self, step: int) -> float:
        """The current sigma (the controller's state, whatever the step)."""
        return self._sigma

    def observe(self, step: int, entropy: float) -> None:
        """Feed back the entropy measured at ``step``; see ``update``."""
        self.update(entropy)

    def state_dict(self) -> dict[str, Any]:
        """Plain-python state: sigma, best entropy, the entropy window and the update count."""
        return {"kind": "entropy_feedback", "sigma": self._sigma, "best_entropy": self.best_entropy,
                "history": list(self.history), "num_updates": self.num_updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()`` output (the sigma is re-clamped to the current bounds)."""
        missing = {"sigma", "best_entropy", "history", "num_updates"} - set(state)
        if missing:
            raise QerlConfigError("noise.controller.state", f"missing keys {sorted(missing)}",
                                  "load a state written by EntropyFeedbackController.state_dict")
        self._sigma = self._clamp(float(state["sigma"]))
        best = state["best_entropy"]
        self.best_entropy = None if best is None else float(best)
        self.history = deque((float(x) for x in state["history"]), maxlen=self.cfg.window)
        self.num_updates = int(state["num_updates"])

    def __repr__(self) -> str:
        return (f"EntropyFeedbackController(sigma={self._sigma}, best_entropy={self.best_entropy}, "
                f"cfg={self.cfg})")
