"""Reward functions, the registry and batch scoring."""

from __future__ import annotations

import json
import math
import threading
from typing import Any

import pytest

from qerl.data.sources import load_reasoning_gym
from qerl.errors import QerlConfigError
from qerl.rewards.base import (
    RewardError,
    WeightedReward,
    available_rewards,
    build_reward,
    build_rewards,
    extract_answer,
)
from qerl.rewards.builtin import score_reasoning_gym
from qerl.rewards.scoring import score_completions


def _one(name: str, completions: list[Any], **kwargs: Any) -> list[float | None]:
    """Build reward ``name`` with ``kwargs`` and call it on completions (+ ``columns``)."""
    columns = kwargs.pop("columns", {})
    fn = build_reward({"name": name, "kwargs": kwargs}).fn
    return fn(prompts=[""] * len(completions), completions=completions, **columns)


# ------------------------------------------------------------------ extract_answer


def test_extract_answer() -> None:
    assert extract_answer("<think>x</think><answer> 42 </answer>") == "42"
    assert extract_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_answer("<answer>  </answer> 7", "last_number") is None
    assert extract_answer("so it is 1,234.", "none") is None
    assert extract_answer("so it is 1,234.", "last_number") == "1,234"
    assert extract_answer("a -3 b 4.5", "last_number") == "4.5"
    assert extract_answer("line one\n  line two  \n\n", "last_line") == "line two"
    assert extract_answer("  whole  ", "full") == "whole"
    assert extract_answer("<answer>unclosed 5", "last_number") == "5"
    assert extract_answer([{"role": "assistant", "content": "<answer>9</answer>"}]) == "9"


# ------------------------------------------------------------------ format


def test_format_reward_values() -> None:
    good = [
        "<think>2+2 is 4</think><answer>4</answer>",
        "  <think>\nmulti\nline\n</think>\n\n<answer> 4 </answer>\n",
    ]
    bad = [
        "<answer>4</answer>",  # no think
        "<think>a</think>",  # no answer
        "<think>a</think><answer>1</answer><answer>2</answer>",  # two answers
        "<think>a</think><answer>4</answer> trailing text",
        "preamble <think>a</think><answer>4</answer>",
        "<think>a</think><answer>  </answer>",  # blank answer
        "<think>a<think>b</think><answer>4</answer>",
        "<answer>4</answer><think>a</think>",  # wrong order
        "",
    ]
    assert _one("format", good + bad) == [0.2, 0.2] + [0.0] * len(bad)
    assert _one("format", good[:1], reward=0.5) == [0.5]


# ------------------------------------------------------------------ exact_match


def test_exact_match_values() -> None:
    completions = [
        "<think>.</think><answer>1,234</answer>",  # commas normalised
        "<think>.</think><answer>42.0</answer>",  # trailing .0
        "<think>.</think><answer>41</answer>",  # wrong
        "the answer is 42.",  # fallback: last number
        "<think>.</think><answer></answer> 42",  # blank answer block: no fallback
        "<answer>7</answer>",  # gold missing -> not applicable
    ]
    golds = ["1234", "42", "42", "42", "42", ""]
    assert _one("exact_match", completions, columns={"answer": golds}) == [
        2.0,
        2.0,
        0.0,
        2.0,
        0.0,
        None,
    ]
    strict = _one("exact_match", completions[3:4], fallback="none", columns={"answer": ["42"]})
    assert strict == [0.0]
    assert _one(
        "exact_match",
        ["<answer>Yes</answer>"],
        ignore_case=True,
        reward=1.0,
        columns={"answer": ["yes"]},
    ) == [1.0]
    assert _one("exact_match", ["<answer>Yes</answer>"], columns={"answer": ["yes"]}) == [0.0]


# ------------------------------------------------------------------ math_verify


def test_math_verify_values() -> None:
    completions = [
        "<think>.</think><answer>\\frac{1}{2}</answer>",
        "<think>.</think><answer>0.5</answer>",
        "<think>.</think><answer>2/4</answer>",
        "<think>.</think><answer>0.6</answer>",
        "<think>.</think><answer>banana</answer>",
        "no tags, final: $\\frac{1}{2}$",  # fallback="full" parses the text
        "<answer>1</answer>",
    ]
    golds = ["0.5", "\\frac{1}{2}", "1/2", "0.5", "0.5", "1/2", ""]
    assert _one("math_verify", completions, columns={"answer": golds}) == [
        1.0,
        1.0,
        1.0,
        0.0,
        0.0,
        1.0,
        None,
    ]


def test_math_verify_works_off_the_main_thread() -> None:
    out: list[Any] = []
    fn = build_reward({"name": "math_verify", "kwargs": {"reward": 3.0}}).fn

    def work() -> None:
        out.extend(
            fn(
                prompts=["", ""],
                completions=["<answer>4</answer>", "<answer>5</answer>"],
                answer=["4", "4"],
            )
        )

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert out == [3.0, 0.0]


# ------------------------------------------------------------------ reasoning_gym


@pytest.fixture(scope="module")
def rg_rows() -> dict[str, list[str]]:
    arith = load_reasoning_gym({"name": "basic_arithmetic", "size": 2, "seed": 0})
    count = load_reasoning_gym({"name": "countdown", "size": 1, "seed": 0})
    rearc = load_reasoning_gym({"name": "rearc", "size": 1, "seed": 0})
    rows: dict[str, list[str]] = {}
    for df in (arith, count, rearc):
        for col in df.columns:
            rows.setdefault(col, []).extend(df[col].tolist())
    return rows


def test_reasoning_gym_reward_values(rg_rows: dict[str, list[str]]) -> None:
    a0, a1, c0, r0 = rg_rows["answer"]
    completions = [
        f"<think>.</think><answer>{a0}</answer>",
        "<think>.</think><answer>999999</answer>",
        "<think>.</think>no answer block",  # countdown's verifier gives 0.01 even for nothing
        f"<answer>{r0}</answer>",  # rearc compares tuples: needs the regenerated entry
    ]
    assert _one("reasoning_gym", completions, columns=rg_rows) == [1.0, 0.0, 0.01, 1.0]
    assert _one("reasoning_gym", completions, scale=2.0, columns=rg_rows) == [2.0, 0.0, 0.02, 2.0]
    assert _one(
        "reasoning_gym", [a1], fallback="full", columns={"metadata": rg_rows["metadata"][1:2]}
    ) == [1.0]


def test_reasoning_gym_reward_not_applicable_and_stored_entry(
    rg_rows: dict[str, list[str]],
) -> None:
    file_meta = json.dumps({"row": {"question": "q", "answer": "1"}, "origin": {"kind": "file"}})
    assert _one("reasoning_gym", ["<answer>1</answer>"], columns={"metadata": [file_meta]}) == [
        None
    ]
    stored_only = json.loads(rg_rows["metadata"][0])
    del stored_only["reasoning_gym"]  # no generator info: score the stored entry
    assert score_reasoning_gym(rg_rows["answer"][0], json.dumps(stored_only)) == 1.0
    assert score_reasoning_gym("nope", stored_only) == 0.0


# ------------------------------------------------------------------ length_penalty


def test_length_penalty_values() -> None:
    comps = ["x" * 5, "x" * 10, "x" * 30]
    assert _one("length_penalty", comps, target=10, per_unit=0.01) == [0.0, 0.0, -0.2]
    capped = _one("length_penalty", comps, target=10, per_unit=0.01, max_penalty=0.1)
    assert capped == [0.0, 0.0, -0.1]
    tokens = _one(
        "length_penalty",
        comps,
        target=3,
        per_unit=0.5,
        unit="tokens",
        columns={"completion_tokens": [1, 3, 7]},
    )
    assert tokens == [0.0, 0.0, -2.0]


# ------------------------------------------------------------------ registry


def test_registry_has_the_builtins() -> None:
    assert set(available_rewards()) >= {
        "format",
        "exact_match",
        "math_verify",
        "reasoning_gym",
        "length_penalty",
    }
    built = build_rewards(["format", {"name": "exact_match", "weight": 0.5, "label": "em"}])
    assert [(r.name, r.weight) for r in built] == [("format", 1.0), ("em", 0.5)]
    assert built[0].fn.__name__ == "format"


@pytest.mark.parametrize(
    ("specs", "field", "extra"),
    [
        ([{"name": "exact_mach"}], "rewards[0].name", "exact_match"),
        ([{"name": "format", "kwargs": {"rewrd": 1}}], "rewards[0].kwargs.rewrd", "reward"),
        (
            [{"name": "exact_match", "kwargs": {"fallback": "first"}}],
            "rewards[0].kwargs.fallback",
            "last_number",
        ),
        ([{"name": "format", "weight": "high"}], "rewards[0].weight", ""),
        ([{"name": "format", "wieght": 1}], "rewards[0].wieght", "weight"),
        ([{"name": "length_penalty", "kwargs": {"unit": "words"}}], "rewards[0].kwargs.unit", ""),
        ([{"name": "format"}, {"name": "format"}], "rewards[1].label", ""),
        ([], "rewards", ""),
    ],
)
def test_bad_reward_specs_name_the_field(specs: list[Any], field: str, extra: str) -> None:
    with pytest.raises(QerlConfigError) as exc:
        build_rewards(specs)
    assert str(exc.value).startswith(f"{field}: ")
    assert extra in str(exc.value)


# ------------------------------------------------------------------ score_completions


def _const(values: list[float | None]):  # noqa: ANN202 - test helper
    def fn(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        return list(values)

    return fn


def test_score_completions_weights_and_none() -> None:
    rewards = [
        WeightedReward("a", _const([1.0, None, 0.5]), 2.0),
        ("b", _const([0.25, 1.0, None]), -1.0),
    ]
    res = score_completions(rewards, ["p"] * 3, ["c"] * 3, {"answer": ["1", "2", "3"]})
    total, per_fn, n_errors = res
    assert total == [1.75, -1.0, 1.0]
    assert per_fn["a"][0] == 2.0 and math.isnan(per_fn["a"][1]) and per_fn["a"][2] == 1.0
    assert per_fn["b"][:2] == [-0.25, -1.0] and math.isnan(per_fn["b"][2])
    assert n_errors == {"a": 0, "b": 0}


def test_score_completions_passes_columns_per_sample() -> None:
    seen: dict[str, Any] = {}

    def fn(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        seen.update(columns, prompts=prompts)
        return [0.0] * len(completions)

    score_completions(
        [("f", fn, 1.0)], ["p0", "p1"], ["c0", "c1"], {"answer": ["1", "2"], "task": ["t", "t"]}
    )
    assert seen == {"answer": ["1", "2"], "task": ["t", "t"], "prompts": ["p0", "p1"]}


def _fails_on_bad(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    return [1.0 if c != "bad" else float(int(c)) for c in completions]


def test_raising_reward_names_function_and_sample() -> None:
    rewards = [("format", _const([0.0, 0.0, 0.0]), 1.0), ("picky", _fails_on_bad, 1.0)]
    with pytest.raises(RewardError) as exc:
        score_completions(rewards, ["p"] * 3, ["ok", "bad", "ok"], {})
    err = exc.value
    assert (err.reward_name, err.index, err.excerpt) == ("picky", 1, "bad")
    assert "'picky'" in str(err) and "sample 1" in str(err) and "ValueError" in str(err)
    assert isinstance(err.__cause__, ValueError)


def test_on_error_zero_scores_zero_and_counts() -> None:
    rewards = [("picky", _fails_on_bad, 2.0), ("one", _const([1.0]), 1.0)]
    res = score_completions(rewards[:1], ["p"] * 4, ["bad", "ok", "bad", "ok"], on_error="zero")
    assert res.total == [0.0, 2.0, 0.0, 2.0]
    assert res.per_fn == {"picky": [0.0, 2.0, 0.0, 2.0]}
    assert res.n_errors == {"picky": 2}
    # a batch result of the wrong length is retried one sample at a time ...
    retried = score_completions(rewards[1:], ["p"] * 2, ["a", "b"], on_error="zero")
    assert retried.total == [1.0, 1.0] and retried.n_errors == {"one": 0}
    # ... and is an error when it stays wrong
    with pytest.raises(RewardError, match="'two'.*sample 0.*length 2 for 1 completions"):
        score_completions([("two", _const([1.0, 1.0]), 1.0)], ["p"], ["c"])
    with pytest.raises(RewardError, match="'text'.*sample 0.*not a number"):
        score_completions([("text", _const(["x"]), 1.0)], ["p"], ["c"])


def test_builtin_error_is_named_with_excerpt() -> None:
    length = build_reward({"name": "length_penalty", "kwargs": {"unit": "tokens"}})
    with pytest.raises(RewardError, match="'length_penalty'.*sample 0.*completion_tokens"):
        score_completions([length], ["p"], ["x" * 100], {})
    res = score_completions([length], ["p"], ["x" * 100], {}, on_error="zero")
    assert res.n_errors == {"length_penalty": 1} and res.total == [0.0]
    with pytest.raises(RewardError) as exc:
        score_completions([length], ["p"], ["y" * 100], {})
    assert exc.value.excerpt == "y" * 60 + "..."


def test_score_completions_bad_inputs() -> None:
    with pytest.raises(QerlConfigError, match=r"^on_error"):
        score_completions([], [], [], on_error="skip")
    with pytest.raises(QerlConfigError, match=r"^columns\.completions"):
        score_completions([("a", _const([1.0]), 1.0)], ["p"], ["c"], {"completions": ["x"]})
    with pytest.raises(QerlConfigError, match=r"^columns\.answer"):
        score_completions([("a", _const([1.0]), 1.0)], ["p"], ["c"], {"answer": ["1", "2"]})


def test_paper_reward_stack_end_to_end(rg_rows: dict[str, list[str]]) -> None:
    rewards = build_rewards(
        [
            {"name": "format"},
            {"name": "exact_match"},
            {"name": "reasoning_gym"},
        ]
    )
    a0 = rg_rows["answer"][0]
    completions = [f"<think>ok</think><answer>{a0}</answer>", f"{a0}", "<think></think>", "x"]
    res = score_completions(rewards, rg_rows["prompt"], completions, rg_rows)
    assert res.per_fn["format"] == [0.2, 0.0, 0.0, 0.0]
    assert res.per_fn["exact_match"][:2] == [2.0, 0.0]  # a0 is row 0's answer, not row 1's
    assert res.per_fn["reasoning_gym"][0] == 1.0
    assert res.total[0] == pytest.approx(3.2)
