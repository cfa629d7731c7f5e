"""Source specs (qerl.data.specs): pydantic models per kind, parse_sources and its messages."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from qerl.data.sources import build_prompt_tables
from qerl.data.specs import (
    FileSource,
    HFSource,
    ReasoningGymSource,
    SourceSpec,
    parse_source,
    parse_sources,
    source_error,
)
from qerl.errors import QerlConfigError


def _raises(field: str, match: str = "") -> pytest.RaisesExc[QerlConfigError]:
    """pytest.raises(QerlConfigError) whose message starts with ``field`` and contains ``match``."""
    return pytest.raises(QerlConfigError, match=rf"(?s)^{re.escape(field)}: .*{match}")


class _Settings(BaseModel):
    """A stand-in for the project settings model: ``data.sources`` typed with the union."""

    sources: list[SourceSpec]


def test_union_is_a_pydantic_field_type() -> None:
    settings = _Settings(
        sources=[
            {"name": "chain_sum", "size": 3},  # kind defaults to reasoning_gym
            {"kind": "file", "path": "not/checked/here.jsonl"},  # the model does no I/O
            {"kind": "hf", "name": "gsm8k", "split": "test"},
        ]
    )
    rg, f, hf = settings.sources
    assert isinstance(rg, ReasoningGymSource) and (rg.size, rg.seed, rg.use) == (3, 0, "both")
    assert isinstance(f, FileSource) and f.file_format == "jsonl"
    assert isinstance(hf, HFSource) and hf.split == "test"
    assert settings.model_dump()["sources"][0]["kind"] == "reasoning_gym"
    with pytest.raises(ValidationError, match="sizes"):
        _Settings(sources=[{"name": "chain_sum", "sizes": 3}])
    with pytest.raises(ValidationError, match="close names"):
        _Settings(sources=[{"name": "chain_sums"}])
    with pytest.raises(ValidationError):
        rg.size = 5  # type: ignore[misc]  # frozen


def test_settings_model_errors_convert_to_the_same_messages() -> None:
    raw = [{"name": "chain_sum"}, {"name": "chain_sum", "seeds": 1}]
    with pytest.raises(ValidationError) as info:
        _Settings(sources=raw)
    err = info.value.errors()[0]
    assert err["loc"][:2] == ("sources", 1)
    converted = source_error({**err, "loc": err["loc"][2:]}, raw[1], "data.sources[1]")
    assert str(converted) == str(_error_of(raw[1], "data.sources[1]"))
    assert converted.field == "data.sources[1].seeds" and "'seed'" in converted.problem


def _error_of(raw: dict[str, Any], field: str) -> QerlConfigError:
    with pytest.raises(QerlConfigError) as info:
        parse_source(raw, field, check_paths=False)
    return info.value


def test_parse_sources_returns_models_and_accepts_models(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n')
    raw = [
        {"name": "chain_sum", "size": 2},
        {"kind": "file", "path": str(path), "format": ".JSONL"},
    ]
    specs = parse_sources(raw)
    assert [type(s) for s in specs] == [ReasoningGymSource, FileSource]
    assert specs[1].format == "jsonl"
    assert parse_sources(specs) == specs  # already-validated models pass through
    train, _ = build_prompt_tables(specs, "plain", eval_size=0)
    assert len(train) == 3


def test_file_existence_is_checked_by_parse_not_by_the_model(tmp_path: Path) -> None:
    raw = [{"kind": "file", "path": str(tmp_path / "missing.jsonl")}]
    assert parse_sources(raw, check_paths=False)[0].path.endswith("missing.jsonl")
    with _raises("data.sources[0].path", match="does not exist"):
        parse_sources(raw)
    (tmp_path / "dir.jsonl").mkdir()
    with _raises("data.sources[0].path", match="is a directory"):
        parse_sources([{"kind": "file", "path": str(tmp_path / "dir.jsonl")}])


@pytest.mark.parametrize(
    ("raw", "field", "problem", "fix"),
    [
        (
            {"name": "basic_arithmetc"},
            "name",
            "close names: ['basic_arithmetic'",
            "registered tasks",
        ),
        ({"name": "countdown", "size": 0}, "size", "must be >= 1, got 0", "use 1 or more"),
        ({"name": "countdown", "size": True}, "size", "expected an integer", "whole number"),
        ({"name": "countdown", "seed": "x"}, "seed", "expected an integer, got 'x'", "whole"),
        ({"name": "countdown", "seeds": 1}, "seeds", "close names: ['seed'", "use only ["),
        (
            {"name": "countdown", "config": {"bogus": 1}},
            "config.bogus",
            "not an option",
            "min_numbers",
        ),
        (
            {"name": "countdown", "config": {"size": 3}},
            "config.size",
            "belongs to the source",
            "move size",
        ),
        (
            {"name": "countdown", "config": {"min_numbers": 6, "max_numbers": 3}},
            "config",
            "rejected by reasoning-gym",
            "allowed",
        ),
        ({"name": "countdown", "config": [1]}, "config", "expected a mapping", "key: value"),
        ({"kind": "sql", "name": "x"}, "kind", "unknown source kind 'sql'", "reasoning_gym"),
        ({"size": 3}, "name", "is required", "set name"),
        ({"name": "countdown", "use": "test"}, "use", "unknown value 'test'", "'eval'"),
        ({"name": "countdown", "id_prefix": 3}, "id_prefix", "expected a string", "quote"),
        ({"kind": "file", "path": "d.txt"}, "path", "suffix '.txt'", "set format"),
        ({"kind": "file", "path": "d.jsonl", "format": "xml"}, "format", "'xml'", "jsonl"),
        (
            {"kind": "file", "path": "d.jsonl", "answer_format": "latex"},
            "answer_format",
            "latex",
            "gsm8k",
        ),
        (
            {"kind": "file", "path": "d.jsonl", "question_column": ""},
            "question_column",
            "is empty",
            "column",
        ),
        ({"kind": "file"}, "path", "is required", "set path"),
        ({"kind": "hf", "name": "x", "split": ""}, "split", "is empty", "e.g. train"),
        ({"kind": "hf", "name": "x", "data_files": 3}, "data_files", "expected a string", "glob"),
    ],
)
def test_bad_source_names_field_problem_and_fix(
    raw: dict[str, Any], field: str, problem: str, fix: str
) -> None:
    with _raises(f"data.sources[0].{field}") as info:
        parse_source(raw, check_paths=False)
    assert problem in info.value.problem, info.value
    assert fix in info.value.fix, info.value


def test_source_level_problems_name_the_source() -> None:
    with _raises("data.sources[2]", match="exactly one of `path` and `name`"):
        parse_sources([{"name": "chain_sum"}, {"name": "chain_sum"}, {"kind": "hf"}])
    with _raises("data.sources[0]", match="expected a mapping"):
        parse_sources(["chain_sum"])
    with _raises("data.sources", match="expected a list"):
        parse_sources({"name": "chain_sum"})
    with _raises("data.sources", match="is empty"):
        parse_sources([])
