"""Warm-start traces: hand-computed examples, and every preset's traces checked step by step and
its warm-start answers scored by the task's own reasoning-gym verifier."""

from __future__ import annotations

import operator
import re
from fractions import Fraction

import pytest

from qerl.embedded.presets import resolve_params, task_of
from qerl.embedded.task import entries
from qerl.embedded.traces import (
    TRACES,
    binary_steps,
    chain_trace,
    columns,
    get_trace,
    signed_columns,
)
from qerl.errors import QerlConfigError
from qerl.params import TinyModelParams
from qerl.rewards.base import extract_answer

_EQ = re.compile(r"(-?\d+(?:[+\-*/]-?\d+)+)=(-?\d+(?:/\d+)?)")


def test_column_scratchpad_of_the_original_default():
    # the embedded default's scratchpad, unchanged
    assert columns(47, "+", 38) == "7+8=15,4+3+1=8"
    assert columns(52, "-", 38) == "12-8=4,5-1-3=1"
    assert chain_trace("47 - 90", use_columns=True) == "90-47:10-7=3,9-1-4=4"
    assert chain_trace("10 + 99", use_columns=True) == "0+9=9,1+9=10"


def test_signed_steps_and_chains():
    assert signed_columns(-43, "+", 12) == "43-12:3-2=1,4-1=3"  # -31
    assert signed_columns(-43, "+", 50) == "50-43:10-3=7,5-1-4=0"  # 7
    assert signed_columns(-43, "-", 12) == "43+12:3+2=5,4+1=5"  # -55
    assert chain_trace("12 - 34 + 5", use_columns=True) == "34-12:4-2=2,3-1=2>-22;22-5:12-5=7,2-1-0=1"
    assert chain_trace("3 + 4 - 5 + 6", use_columns=False) == "3+4=7,7-5=2,2+6=8"
    assert binary_steps("2 * 3 - 1") == [(2, "*", 3, 6), (6, "-", 1, 5)]
    assert binary_steps("7 / 2") is None and binary_steps("x + 1") is None
    assert chain_trace("2 * 3", use_columns=True) is None


def test_other_kinds():
    legs = {"metadata": {"animals": {"grasshopper": 3, "jellyfish": 2, "tiger": 2}}}
    assert TRACES["legs"](legs) == "3*6=18,2*0=0,2*4=8;18+0=18,18+8=26"
    eq = {"metadata": {"equation": "5 - 8*e = -51", "variable": "e"}}
    assert TRACES["solve"](eq) == "-51-5=-56,-56/-8=7"
    assert TRACES["solve"]({"metadata": {"equation": "7*m = 35", "variable": "m"}}) == "35/7=5"
    assert TRACES["spell"]({"metadata": {"word": "bliss"}}) == "b1l2i3s4s5"
    span = {"metadata": {"span": ["Rabbit", "cat", "Bob"], "target_letter": "b"}}
    assert TRACES["letters"](span) == "Rabbit:2,Bob:2;2+2=4"
    assert TRACES["column"]({"metadata": {}}) is None
    with pytest.raises(QerlConfigError, match="embedded_model.task.trace"):
        get_trace("colum")


def _true(expr: str, value: str) -> bool:
    """Does a written step ``a op b (op c) = r`` hold? Evaluated left to right, exactly."""
    nums = [Fraction(n) for n in re.findall(r"(?:(?<=^)|(?<=[+\-*/]))-?\d+", expr)]
    ops = re.findall(r"(?<=\d)[+\-*/]", expr)
    acc = nums[0]
    for op, n in zip(ops, nums[1:], strict=True):
        acc = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}[op](acc, n)
    return acc == Fraction(value)


@pytest.mark.parametrize(
    "name",
    ["chain_sum_2x2", "chain_sum_4x1", "chain_sum_2x3", "chain_sum_3x2", "leg_counting", "simple_equations",
     "spell_backward", "letter_counting"],
)
def test_every_preset_trace_is_correct(presets, name):
    params = resolve_params(TinyModelParams.model_validate({"task": {"preset": name, "trace_fraction": 1.0}}), presets)
    task = task_of(params)
    rows = task.prompt_table(150, seed=5)
    score = rows_score(task)
    prompts, comps = task.sft_pairs(rows, seed=0)
    n_traced = 0
    for entry, prompt, comp in zip(entries(rows), prompts, comps, strict=True):
        assert prompt == task.template.replace("{question}", entry["question"])
        think = comp[len("<think>") : comp.index("</think>")]
        n_traced += bool(think)
        # the warm-start answer is right per the task's own verifier
        assert score(extract_answer(comp), entry) == 1.0, (entry["question"], comp)
        for expr, value in _EQ.findall(think):  # and so is every step written in the trace
            assert _true(expr, value), (think, expr, value)
        if task.trace == "letters" and think:
            hits = [re.fullmatch(r"(.*):(\d+)", h).groups() for h in think.split(";")[0].split(",")]
            letter = entry["metadata"]["target_letter"]
            assert all(w.lower().count(letter) == int(n) for w, n in hits)
            assert sum(int(n) for _, n in hits) == int(entry["answer"])
        if task.trace in ("steps", "legs", "solve") and think:
            assert Fraction(think.rsplit("=", 1)[1]) == Fraction(entry["answer"])
        if task.trace == "column":
            totals = [r for _, _, _, r in binary_steps(entry["metadata"]["expression"])]
            assert [int(x) for x in re.findall(r">(-?\d+)", think)] == totals[:-1]
        if task.trace == "spell" and think:
            assert "".join(re.findall(r"[^\d]", think))[::-1] == entry["answer"]
    assert n_traced >= 0.95 * len(rows)


def rows_score(task):
    import reasoning_gym

    return reasoning_gym.create_dataset(task.name, seed=0, size=1, **dict(task.config)).score_answer
