"""Warm-start ``<think>`` traces: one builder per *kind* of task, read from reasoning-gym's metadata.

A trace builder takes a reasoning-gym entry (``question``, ``answer``, ``metadata``) and returns the
text that goes inside ``<think>...</think>`` before the answer, or ``None`` when it cannot build
one for that entry (the warm start then answers directly). Builders are registered by name
(:data:`TRACES`, :func:`get_trace`) and chosen per task preset (``embedded_model.task.trace``):

========== ======================================= =========================================
name       tasks                                   example (answer after the arrow)
========== ======================================= =========================================
``none``   any                                     (always answer directly)
``column`` chain_sum (+/- chains, any digits)      ``47 + 38``: ``7+8=15,4+3+1=8`` -> 85
``steps``  chain_sum with short terms              ``3 + 4 - 5``: ``3+4=7,7-5=2`` -> 2
``legs``   leg_counting                            ``3 ducks, 2 cows``: ``3*2=6,2*4=8;6+8=14``
``solve``  simple_equations (linear, one variable) ``8*t - 9 = 23``: ``23+9=32,32/8=4`` -> 4
``spell``  spell_backward                          ``bliss``: ``b1l2i3s4s5`` -> ssilb
``letters`` letter_counting                        ``"b"`` in ``rabbit bob``: ``rabbit:2,bob:2;2+2=4``
========== ======================================= =========================================

``column`` writes one column-arithmetic scratchpad per binary step of the chain, least significant
digit first with carries / borrows; when the magnitudes must be handled in another order (a
negative running total, or ``a - b`` with ``a < b``) the magnitude operation comes first
(``90-47:``), and every intermediate result follows its step (``>85;``). For two non-negative
terms it is exactly the scratchpad of the original embedded default.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Mapping
from typing import Any

from qerl.errors import QerlConfigError

TraceBuilder = Callable[[Mapping[str, Any]], "str | None"]

TRACES: dict[str, TraceBuilder] = {}

_OPS: dict[type, tuple[str, Callable[[Any, Any], Any]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
}


def register_trace(name: str) -> Callable[[TraceBuilder], TraceBuilder]:
    """Decorator registering a trace builder under ``name``."""

    def deco(fn: TraceBuilder) -> TraceBuilder:
        TRACES[name] = fn
        return fn

    return deco


def get_trace(name: str, field: str = "embedded_model.task.trace") -> TraceBuilder:
    """The registered builder ``name``; a :class:`QerlConfigError` naming ``field`` otherwise."""
    if name not in TRACES:
        raise QerlConfigError(field, f"unknown trace style {name!r}", f"use one of {sorted(TRACES)}")
    return TRACES[name]


def _meta(entry: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = entry.get("metadata") or {}
    return meta if isinstance(meta, Mapping) else {}


# --------------------------------------------------------------------------------------------
# Arithmetic chains
# --------------------------------------------------------------------------------------------


def binary_steps(expression: str) -> list[tuple[int, str, int, int]] | None:
    """``(x, op, y, result)`` for every binary +, -, * of an integer expression, in evaluation
    order (left to right for a chain). None for anything else (division, floats, names)."""
    try:
        tree = ast.parse(expression.strip(), mode="eval").body
    except SyntaxError:
        return None
    steps: list[tuple[int, str, int, int]] = []

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            x, y = ev(node.left), ev(node.right)
            sym, fn = _OPS[type(node.op)]
            steps.append((x, sym, y, fn(x, y)))
            return fn(x, y)
        raise ValueError(f"unsupported node {type(node).__name__}")

    try:
        ev(tree)
    except ValueError:
        return None
    return steps


def columns(a: int, op: str, b: int) -> str:
    """Column scratchpad of ``a + b`` or ``a - b`` (``a >= b >= 0`` for ``-``), least significant
    column first: ``47 + 38 -> 7+8=15,4+3+1=8``, ``52 - 38 -> 12-8=4,5-1-3=1``."""
    da, db = str(a)[::-1], str(b)[::-1]
    out, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        if op == "+":
            r = x + y + carry
            out.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={r}")
            carry = r // 10
        else:
            borrow = 1 if x - carry < y else 0
            top = x + 10 * borrow
            out.append(f"{top}" + ("-1" if carry else "") + f"-{y}={top - carry - y}")
            carry = borrow
    return ",".join(out)


def signed_columns(x: int, op: str, y: int) -> str:
    """Column scratchpad of ``x op y`` for any signed ``x`` and ``y``: the magnitudes are added or
    the smaller is subtracted from the larger; when that is not literally ``x op y`` the magnitude
    operation is written first (``47 - 90 -> 90-47:10-7=3,9-1-4=4``; ``-43 + 12 -> 43-12:...``)."""
    v = y if op == "+" else -y  # x op y == x + v
    if (x >= 0) == (v >= 0):
        a, b, mop = abs(x), abs(v), "+"
    else:
        a, b, mop = max(abs(x), abs(v)), min(abs(x), abs(v)), "-"
    literal = x >= 0 and y >= 0 and (a, mop, b) == (x, op, y)
    return ("" if literal else f"{a}{mop}{b}:") + columns(a, mop, b)


def chain_trace(expression: str, use_columns: bool) -> str | None:
    """The trace of a +/- chain: per step a column scratchpad with the running result after each
    step but the last (``use_columns``), or just the steps ``x op y = r``."""
    steps = binary_steps(expression)
    if not steps or any(op == "*" for _, op, _, _ in steps):
        return None
    if not use_columns:
        return ",".join(f"{x}{op}{y}={r}" for x, op, y, r in steps)
    parts = [signed_columns(x, op, y) for x, op, y, _ in steps]
    return ";".join(p + (f">{r}" if i < len(steps) - 1 else "") for i, (p, (_, _, _, r)) in enumerate(zip(parts, steps, strict=True)))


@register_trace("none")
def no_trace(entry: Mapping[str, Any]) -> str | None:
    """Always answer directly."""
    return None


@register_trace("column")
def column_trace(entry: Mapping[str, Any]) -> str | None:
    """Column arithmetic for a +/- chain in ``metadata.expression`` (chain_sum)."""
    expr = _meta(entry).get("expression")
    return chain_trace(expr, use_columns=True) if isinstance(expr, str) else None


@register_trace("steps")
def steps_trace(entry: Mapping[str, Any]) -> str | None:
    """Running results of a +/- chain in ``metadata.expression`` (chain_sum with short terms)."""
    expr = _meta(entry).get("expression")
    return chain_trace(expr, use_columns=False) if isinstance(expr, str) else None


# --------------------------------------------------------------------------------------------
# Other generators
# --------------------------------------------------------------------------------------------


@register_trace("legs")
def legs_trace(entry: Mapping[str, Any]) -> str | None:
    """leg_counting: ``count*legs`` per animal (reasoning-gym's own leg table), then the sum."""
    from reasoning_gym.arithmetic.leg_counting import ANIMALS

    animals = _meta(entry).get("animals")
    if not isinstance(animals, Mapping) or not animals or any(a not in ANIMALS for a in animals):
        return None
    products = [int(n) * ANIMALS[a] for a, n in animals.items()]
    head = ",".join(f"{n}*{ANIMALS[a]}={p}" for (a, n), p in zip(animals.items(), products, strict=True))
    if len(products) == 1:
        return head
    return head + ";" + chain_trace(" + ".join(map(str, products)), use_columns=False)


@register_trace("solve")
def solve_trace(entry: Mapping[str, Any]) -> str | None:
    """simple_equations: undo the constant, then the coefficient (``8*t - 9 = 23``:
    ``23+9=32,32/8=4``), with sympy reading the linear equation."""
    import sympy

    meta = _meta(entry)
    equation, var = meta.get("equation"), meta.get("variable")
    if not isinstance(equation, str) or not isinstance(var, str) or equation.count("=") != 1:
        return None
    x = sympy.Symbol(var)
    try:
        lhs, rhs = (sympy.sympify(side, locals={var: x}) for side in equation.split("="))
    except (sympy.SympifyError, SyntaxError, TypeError):
        return None
    k, b = lhs.coeff(x, 1), lhs.subs(x, 0)  # lhs = k*x + b, rhs = r
    if not (rhs.is_Integer and k.is_Integer and b.is_Integer) or k == 0 or sympy.expand(lhs - k * x - b) != 0:
        return None
    k, b, r = int(k), int(b), int(rhs)
    steps = [f"{r}{-b:+d}={r - b}"] if b else []
    if k != 1:
        q = sympy.Rational(r - b, k)
        steps.append(f"{r - b}/{k}={q}")
    return ",".join(steps) or None


@register_trace("spell")
def spell_trace(entry: Mapping[str, Any]) -> str | None:
    """spell_backward: the word letter by letter with positions (``bliss``: ``b1l2i3s4s5``)."""
    word = _meta(entry).get("word")
    if not isinstance(word, str) or not word:
        return None
    return "".join(f"{ch}{i}" for i, ch in enumerate(word, start=1))


@register_trace("letters")
def letters_trace(entry: Mapping[str, Any]) -> str | None:
    """letter_counting: every word holding the letter with its count (case-insensitive, as the
    generator counts), then the sum (``rabbit:2,bob:2;2+2=4``)."""
    meta = _meta(entry)
    span, letter = meta.get("span"), meta.get("target_letter")
    if not isinstance(span, list) or not isinstance(letter, str) or len(letter) != 1:
        return None
    hits = [(w, w.lower().count(letter)) for w in span if letter in w.lower()]
    if not hits:
        return "0"
    head = ",".join(f"{w}:{n}" for w, n in hits)
    if len(hits) == 1:
        return head
    return head + ";" + chain_trace(" + ".join(str(n) for _, n in hits), use_columns=False)
