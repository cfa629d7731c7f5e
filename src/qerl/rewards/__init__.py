"""Reward functions (TRL's calling convention), their registry and batch scoring.

Importing the package registers the built-in rewards (``qerl.rewards.builtin``)."""

from qerl.rewards import builtin as _builtin  # noqa: F401  (registers format, exact_match, ...)
