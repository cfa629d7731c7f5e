"""Input checks of file / HF sources: column dtypes, empty inputs, nothing silently stringified."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from qerl.data.sources import build_prompt_tables, load_file, load_hf
from qerl.errors import QerlConfigError


def _raises(field: str, match: str = "") -> pytest.RaisesExc[QerlConfigError]:
    return pytest.raises(QerlConfigError, match=rf"(?s)^{re.escape(field)}: .*{match}")


def test_parquet_with_integer_questions_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.parquet"
    pd.DataFrame({"question": [0, 1], "answer": [[1.0, 2.0], [3.0]]}).to_parquet(path)
    with _raises("data.sources[0].question_column") as info:
        load_file({"path": str(path)})
    err = info.value
    assert "'question'" in err.problem and "dtype int64" in err.problem and str(path) in err.problem
    assert "must hold text" in err.problem and "strings" in err.fix


def test_parquet_with_list_answers_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "lists.parquet"
    pd.DataFrame({"q": ["1+1?", "2+2?"], "a": [[1.0, 2.0], [3.0]]}).to_parquet(path)
    with _raises("data.sources[0].answer_column") as info:
        load_file({"path": str(path), "question_column": "q", "answer_column": "a"})
    err = info.value
    assert "'a'" in err.problem and "dtype object" in err.problem and "list values" in err.problem
    assert "row 0" in err.problem and "scalars" in err.problem and "one answer per row" in err.fix


def test_jsonl_with_dict_answers_and_one_numeric_question(tmp_path: Path) -> None:
    path = tmp_path / "mixed.jsonl"
    rows = [{"question": "ok?", "answer": "1"}, {"question": 7, "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with _raises("data.sources[0].question_column", match=r"holding int values \(row 1: '7'\)"):
        load_file({"path": str(path)})
    path.write_text(json.dumps({"question": "q", "answer": {"value": 3}}) + "\n")
    with _raises("data.sources[0].answer_column", match="dict values"):
        load_file({"path": str(path)})


def test_numeric_answers_and_missing_cells_stay_accepted(tmp_path: Path) -> None:
    path = tmp_path / "ok.parquet"
    pd.DataFrame({"question": ["a?", None, "c?"], "answer": [1.0, 2.0, None]}).to_parquet(path)
    df = load_file({"path": str(path)})
    assert df["answer"].tolist() == ["1"]  # None question and None answer are dropped, not refused


@pytest.mark.parametrize(
    ("name", "write"),
    [
        ("zero.jsonl", lambda p: p.write_bytes(b"")),
        ("zero.csv", lambda p: p.write_bytes(b"")),
        ("array.json", lambda p: p.write_text("[]")),
        ("header.csv", lambda p: p.write_text("question,answer\n")),
        ("rows0.parquet", lambda p: pd.DataFrame({"question": [], "answer": []}).to_parquet(p)),
    ],
)
def test_empty_file_is_called_empty(tmp_path: Path, name: str, write: Any) -> None:
    path = tmp_path / name
    write(path)
    with _raises("data.sources[0].path") as info:
        load_file({"path": str(path)})
    assert info.value.problem == f"{path} is empty (0 rows)"
    assert "column" not in info.value.problem


def test_empty_file_is_caught_in_build_too(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    sources = [{"name": "chain_sum", "size": 5}, {"kind": "file", "path": str(path)}]
    with _raises("data.sources[1].path", match=r"is empty \(0 rows\)"):
        build_prompt_tables(sources, "plain", eval_size=0)


def test_empty_hf_split_is_called_empty(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"question": ["q"], "answer": ["1"]})
    dd = datasets.DatasetDict({"train": ds, "test": ds.select([])})
    dd.save_to_disk(str(tmp_path / "dd"), num_shards={"train": 1, "test": 1})
    with _raises("data.sources[0].path", match=r"split 'test' of .*dd' is empty \(0 rows\)"):
        load_hf({"path": str(tmp_path / "dd"), "split": "test"})


def test_hf_list_answers_are_refused(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"question": ["q1", "q2"], "answer": [[1, 2], [3]]})
    ds.save_to_disk(str(tmp_path / "lists"))
    with _raises("data.sources[0].answer_column", match="list values"):
        load_hf({"path": str(tmp_path / "lists")})


def test_unparseable_file_keeps_its_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not a parquet file at all")
    with _raises("data.sources[0].path", match="could not read"):
        load_file({"path": str(path)})
