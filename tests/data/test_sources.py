"""Prompt sources (reasoning-gym, files, HF datasets), the split and the prompt-table schema."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from qerl.data.schema import (
    PROMPT_COLUMNS,
    normalize_answer,
    validate_prompt_table,
)
from qerl.data.sources import (
    build_prompt_tables,
    load_file,
    load_hf,
    load_reasoning_gym,
    load_source,
    parse_gold_answer,
    parse_source,
    split_train_eval,
)
from qerl.data.templates import get_template
from qerl.errors import QerlConfigError

GSM_ROWS: list[dict[str, Any]] = [
    {"question": "Tom has 2 apples and buys 2 more. How many?", "answer": "2 + 2 = 4\n#### 4"},
    {"question": "A big number?", "answer": "It is big.\n#### 1,234"},
    {"question": "Half of 5?", "answer": "#### 2.5"},
    {"question": "", "answer": "#### 9"},
    {"question": "No answer here", "answer": None},
]


def _raises(field: str, match: str = "") -> pytest.RaisesExc[QerlConfigError]:
    """pytest.raises(QerlConfigError) whose message starts with ``field`` and contains ``match``."""
    return pytest.raises(QerlConfigError, match=rf"(?s)^{re.escape(field)}: .*{match}")


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------ schema and helpers


def test_parse_gold_answer_gsm8k_convention() -> None:
    assert parse_gold_answer("3 + 4 = 7\n#### 7") == ("7", "3 + 4 = 7\n#### 7")
    assert parse_gold_answer("#### 1,234,567")[0] == "1234567"
    assert parse_gold_answer("a #### b #### 12.50")[0] == "12.5"
    assert parse_gold_answer(" 42 ", "auto") == ("42", None)
    assert parse_gold_answer("no marker", "gsm8k") == (None, "no marker")
    assert parse_gold_answer("x #### 5", "raw") == ("x #### 5", None)


def test_normalize_answer() -> None:
    assert normalize_answer(" 1,000 ") == "1000"
    assert normalize_answer("42.0") == "42"
    assert normalize_answer("$3.50") == "3.5"
    assert normalize_answer("\\boxed{7}") == "7"
    assert normalize_answer("Yes.") == "Yes"
    assert normalize_answer("1,2,3") == "1,2,3"


def test_validate_prompt_table_rejects_bad_tables() -> None:
    good = load_reasoning_gym({"name": "basic_arithmetic", "size": 3, "seed": 0})
    assert validate_prompt_table(good) is good
    with pytest.raises(QerlConfigError, match="missing column"):
        validate_prompt_table(good.drop(columns=["messages"]), "t")
    bad = good.copy()
    bad["answer"] = [1, 2, 3]
    with pytest.raises(QerlConfigError, match=r"^t\.answer: row 0"):
        validate_prompt_table(bad, "t")
    dup = good.copy()
    dup["id"] = ["a", "a", "b"]
    with pytest.raises(QerlConfigError, match=r"^t\.id: 1 duplicate"):
        validate_prompt_table(dup, "t")
    meta = good.copy()
    meta["metadata"] = ["[]"] * 3
    with pytest.raises(QerlConfigError, match=r"^t\.metadata"):
        validate_prompt_table(meta, "t")


# ------------------------------------------------------------------ reasoning-gym


def test_reasoning_gym_source_schema_ids_and_metadata() -> None:
    spec = {"name": "basic_arithmetic", "size": 5, "seed": 1}
    df = load_reasoning_gym(spec, get_template("qerl"))
    assert list(df.columns) == list(PROMPT_COLUMNS)
    validate_prompt_table(df)
    assert df["id"].tolist() == [f"basic_arithmetic-s1:{i}" for i in range(5)]
    assert set(df["source"]) == {"reasoning_gym"} and set(df["task"]) == {"basic_arithmetic"}
    meta = json.loads(df["metadata"][0])
    assert meta["entry"]["question"] == df["question"][0]
    assert meta["entry"]["answer"] == df["answer"][0]
    assert meta["entry"]["metadata"]["source_dataset"] == "basic_arithmetic"
    assert meta["reasoning_gym"] == {
        "name": "basic_arithmetic",
        "config": {},
        "seed": 1,
        "size": 5,
        "index": 0,
    }
    assert "<answer>" in df["prompt"][0] and df["prompt"][0].endswith(df["question"][0])
    pd.testing.assert_frame_equal(df, load_reasoning_gym(spec, get_template("qerl")))


def test_reasoning_gym_config_changes_id_prefix() -> None:
    df = load_source({"name": "chain_sum", "size": 2, "config": {"min_terms": 2, "max_terms": 2}})
    assert df["id"][0].startswith("chain_sum-s0-c") and df["id"][0].endswith(":0")


# ------------------------------------------------------------------ local files


def test_jsonl_gsm8k_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _write_jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    with caplog.at_level(logging.WARNING, logger="qerl.data.rows"):
        df = load_file({"path": str(path)})
    validate_prompt_table(df)
    assert df["answer"].tolist() == ["4", "1234", "2.5"]
    assert df["id"].tolist() == ["gsm:0", "gsm:1", "gsm:2"]
    assert set(df["source"]) == {"file"} and set(df["task"]) == {"gsm"}
    assert df["prompt"][0] == GSM_ROWS[0]["question"]
    meta = json.loads(df["metadata"][1])
    assert meta["solution"] == "It is big.\n#### 1,234"
    assert meta["row"] == GSM_ROWS[1] and meta["origin"]["row"] == 1
    assert "dropped 2 of 5 rows (1 empty question, 1 empty answer)" in caplog.text


def test_parquet_file_with_custom_columns_and_id_column(tmp_path: Path) -> None:
    raw = pd.DataFrame({"problem": ["1+1?", "2+3?"], "solution": [2, 5.0], "uid": ["a", "b"]})
    path = tmp_path / "toy.parquet"
    raw.to_parquet(path)
    df = load_file(
        {
            "path": str(path),
            "question_column": "problem",
            "answer_column": "solution",
            "id_column": "uid",
            "task": "toy_math",
            "id_prefix": "tm",
        }
    )
    assert df["id"].tolist() == ["tm:a", "tm:b"]
    assert df["answer"].tolist() == ["2", "5"]
    assert set(df["task"]) == {"toy_math"}


def test_csv_file_drops_empty_cells(tmp_path: Path) -> None:
    path = tmp_path / "qa.csv"
    path.write_text('question,answer\n"What, exactly?",007\nNo answer,\n,3\nNA is a word,NA\n')
    df = load_file({"path": str(path)})
    assert df["question"].tolist() == ["What, exactly?", "NA is a word"]
    assert df["answer"].tolist() == ["7", "NA"]


def test_missing_file_names_field_and_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with _raises("data.sources[0].path") as exc:
        load_file({"path": str(missing)})
    assert str(missing) in str(exc.value)


def test_missing_column_lists_available_columns(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "q.jsonl", [{"prompt": "x", "answer": "1"}])
    with _raises("data.sources[0].question_column") as exc:
        load_file({"path": str(path)})
    assert "['prompt', 'answer']" in str(exc.value)


def test_file_empty_after_filtering_raises(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "e.jsonl", [{"question": "", "answer": "1"}])
    with _raises("data.sources[0]", match="no usable rows"):
        load_file({"path": str(path)})
    strict = _write_jsonl(tmp_path / "s.jsonl", [{"question": "q", "answer": "no marker"}])
    with _raises("data.sources[0]", match="no usable rows"):
        load_file({"path": str(strict), "answer_format": "gsm8k"})


def test_file_bad_options(tmp_path: Path) -> None:
    txt = tmp_path / "data.txt"
    txt.write_text("x")
    with _raises("data.sources[0].path", match="suffix"):
        load_file({"path": str(txt)})
    with _raises("data.sources[0].format"):
        load_file({"path": str(txt), "format": "xml"})
    path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "1", "k": 1}] * 2)
    with _raises("data.sources[0].id_column", match="duplicate"):
        load_file({"path": str(path), "id_column": "k"})
    with _raises("data.sources[0].answer_format"):
        load_file({"path": str(path), "answer_format": "latex"})


# ------------------------------------------------------------------ Hugging Face datasets


def test_hf_save_to_disk_dataset_and_dict(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(GSM_ROWS[:3])
    ds.save_to_disk(str(tmp_path / "one"))
    df = load_hf({"path": str(tmp_path / "one")})
    validate_prompt_table(df)
    assert df["answer"].tolist() == ["4", "1234", "2.5"]
    assert df["id"][0] == "one-train:0" and set(df["source"]) == {"hf"}

    datasets.DatasetDict({"train": ds, "test": ds.select([2])}).save_to_disk(str(tmp_path / "dd"))
    test = load_hf({"path": str(tmp_path / "dd"), "split": "test", "task": "gsm8k"})
    assert test["answer"].tolist() == ["2.5"] and test["id"][0] == "dd-test:0"
    with _raises("data.sources[0].split") as exc:
        load_hf({"path": str(tmp_path / "dd"), "split": "validation"})
    assert "['train', 'test']" in str(exc.value)


def test_hf_data_files_then_cached_name_offline(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    data_dir = tmp_path / "toy_gsm"
    data_dir.mkdir()
    _write_jsonl(data_dir / "train.jsonl", GSM_ROWS[:2])
    cache = tmp_path / "cache"
    by_path = load_hf({"path": str(data_dir), "cache_dir": str(cache)})
    assert by_path["answer"].tolist() == ["4", "1234"]
    one_file = load_hf({"path": str(data_dir / "train.jsonl"), "cache_dir": str(cache)})
    assert one_file["answer"].tolist() == ["4", "1234"]
    shutil.rmtree(data_dir)  # now only the cache has it: load it by name, offline
    by_name = load_hf({"name": "toy_gsm", "cache_dir": str(cache)})
    assert by_name["answer"].tolist() == ["4", "1234"]
    assert by_name["id"][0] == "toy_gsm-train:0"


def test_hf_name_not_cached_is_a_clear_error(tmp_path: Path) -> None:
    pytest.importorskip("datasets")
    with _raises("data.sources[0].name") as exc:
        load_hf({"name": "someone/not-here", "cache_dir": str(tmp_path / "empty")})
    assert "not in the local Hugging Face cache" in str(exc.value)
    assert "save_to_disk" in exc.value.fix


def test_hf_bad_specs(tmp_path: Path) -> None:
    with _raises("data.sources[0]", match="exactly one"):
        parse_source({"kind": "hf", "path": str(tmp_path), "name": "x"})
    with _raises("data.sources[0].path", match="does not exist"):
        parse_source({"kind": "hf", "path": str(tmp_path / "missing")})


# ------------------------------------------------------------------ build + split

RG_SOURCES = [
    {"name": "basic_arithmetic", "size": 30, "seed": 0},
    {"name": "chain_sum", "size": 10, "seed": 0},
]


def test_build_is_deterministic_and_seed_dependent() -> None:
    tr1, ev1 = build_prompt_tables(RG_SOURCES, "qerl", eval_size=8, seed=1)
    tr2, ev2 = build_prompt_tables(RG_SOURCES, "qerl", eval_size=8, seed=1)
    pd.testing.assert_frame_equal(tr1, tr2)
    pd.testing.assert_frame_equal(ev1, ev2)
    _, ev3 = build_prompt_tables(RG_SOURCES, "qerl", eval_size=8, seed=2)
    assert set(ev3["id"]) != set(ev1["id"])
    assert len(tr1) == 32 and len(ev1) == 8
    assert not set(tr1["id"]) & set(ev1["id"])
    assert tr1["id"].is_unique
    assert ev1["task"].value_counts().to_dict() == {"basic_arithmetic": 6, "chain_sum": 2}


def test_split_does_not_depend_on_row_order() -> None:
    df = load_reasoning_gym({"name": "basic_arithmetic", "size": 20})
    _, ev_a = split_train_eval(df, eval_fraction=0.25, seed=3)
    _, ev_b = split_train_eval(df.iloc[::-1], eval_fraction=0.25, seed=3)
    assert ev_a["id"].tolist() == ev_b["id"].tolist() and len(ev_a) == 5


def test_build_default_fraction_and_caps() -> None:
    tr, ev = build_prompt_tables(RG_SOURCES, "plain", seed=0)
    assert (len(tr), len(ev)) == (36, 4)
    capped, ev_capped = build_prompt_tables(RG_SOURCES, "plain", seed=0, max_prompts=5)
    assert len(capped) == 5 and capped["id"].tolist() == tr["id"].tolist()[:5]
    pd.testing.assert_frame_equal(ev, ev_capped)


def test_build_max_prompt_chars(caplog: pytest.LogCaptureFixture) -> None:
    sources = [{"name": "basic_arithmetic", "size": 20, "seed": 0}]
    full, _ = build_prompt_tables(sources, "plain", eval_size=0)
    limit = int(full["prompt"].str.len().median())
    n_long = int((full["prompt"].str.len() > limit).sum())
    with caplog.at_level(logging.WARNING, logger="qerl.data.sources"):
        tr, ev = build_prompt_tables(sources, "plain", eval_size=0, max_prompt_chars=limit)
    assert len(tr) + len(ev) == 20 - n_long > 0
    assert (tr["prompt"].str.len() <= limit).all()
    assert f"dropped {n_long} of 20 prompts" in caplog.text
    with _raises("data.max_prompt_chars"):
        build_prompt_tables(sources, "qerl", max_prompt_chars=10)


def test_build_use_eval_and_train_sources(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "gsm_test.jsonl", GSM_ROWS[:3])
    sources = [
        {"name": "basic_arithmetic", "size": 10, "use": "train"},
        {"kind": "file", "path": str(path), "use": "eval"},
    ]
    tr, ev = build_prompt_tables(sources, "qerl", seed=0)
    assert len(tr) == 10 and set(tr["task"]) == {"basic_arithmetic"}
    assert sorted(ev["id"]) == ["gsm_test:0", "gsm_test:1", "gsm_test:2"]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"eval_fraction": 0.1, "eval_size": 3}, "data.eval_size"),
        ({"eval_fraction": 1.5}, "data.eval_fraction"),
        ({"eval_size": 40}, "data.eval_size"),
        ({"eval_size": -1}, "data.eval_size"),
        ({"max_prompts": 0}, "data.max_prompts"),
        ({"seed": 1.5}, "data.seed"),
        ({"template": "no placeholder"}, "data.template"),
        ({"sources": []}, "data.sources"),
        ({"sources": {"name": "countdown"}}, "data.sources"),
        ({"sources": [*RG_SOURCES, {"name": "nope_task"}]}, "data.sources[2].name"),
        ({"sources": [RG_SOURCES[0], RG_SOURCES[0]]}, "data.sources[1].id_prefix"),
        ({"sources": [{"name": "countdown", "size": 3, "use": "eval"}]}, "data.sources"),
    ],
)
def test_build_bad_params_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    kwargs = {"sources": RG_SOURCES, **kwargs}
    with _raises(field):
        build_prompt_tables(**kwargs)


def test_bad_source_is_caught_before_loading_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    import qerl.data.sources as sources

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("loaded before validating every source")

    monkeypatch.setattr(sources, "load_source", boom)
    with _raises("data.sources[1].path"):
        build_prompt_tables([RG_SOURCES[0], {"kind": "file", "path": "/no/such/file.jsonl"}])
