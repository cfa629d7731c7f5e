"""Errors users see. Every message names the offending field and says how to fix it."""

from __future__ import annotations


class QerlConfigError(ValueError):
    """Bad parameters or inputs, raised before any expensive work starts.

    Args:
        field: dotted name of the parameter or input at fault (e.g. ``quant.format``).
        problem: what is wrong with it.
        fix: what the user should do instead.
    """

    def __init__(self, field: str, problem: str, fix: str) -> None:
        self.field = field
        self.problem = problem
        self.fix = fix
        super().__init__(f"{field}: {problem}. Fix: {fix}")
