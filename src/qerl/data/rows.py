"""Raw question/answer tables -> prompt-table rows (:mod:`qerl.data.schema`).

Shared by the file and Hugging Face loaders: the input checks (the table is not empty, the
configured columns exist, questions are text and answers are scalars), gold-answer parsing
(GSM8K's ``#### 42``), ids, metadata and prompt rendering.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
from collections.abc import Mapping
from decimal import Decimal
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from qerl.data.schema import (
    COL_ANSWER,
    COL_ID,
    COL_MESSAGES,
    COL_METADATA,
    COL_PROMPT,
    COL_QUESTION,
    COL_SOURCE,
    COL_TASK,
    PROMPT_COLUMNS,
    normalize_answer,
)
from qerl.data.specs import FileSource, HFSource, ReasoningGymSource, SourceModel, close_names
from qerl.data.templates import NAMED_TEMPLATES, PromptTemplate
from qerl.errors import QerlConfigError

logger = logging.getLogger(__name__)


def _json_default(obj: Any) -> Any:
    """JSON fallback for numpy scalars / arrays, sets and anything else (as text)."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    return str(obj)


def to_json(obj: Any) -> str:
    """Serialise ``obj`` to JSON the way prompt-table columns store it."""
    return json.dumps(obj, default=_json_default, ensure_ascii=False)


def _config_hash(config: Mapping[str, Any]) -> str:
    """Short stable hash of a config mapping."""
    text = json.dumps(dict(config), sort_keys=True, default=_json_default)
    return hashlib.sha1(text.encode()).hexdigest()[:8]


def default_id_prefix(spec: SourceModel) -> str:
    """The id prefix used when ``id_prefix`` is not set."""
    if spec.id_prefix:
        return spec.id_prefix
    if isinstance(spec, ReasoningGymSource):
        suffix = f"-c{_config_hash(spec.config)}" if spec.config else ""
        return f"{spec.name}-s{spec.seed}{suffix}"
    if isinstance(spec, FileSource):
        return Path(spec.path).stem
    base = spec.name if spec.name is not None else Path(str(spec.path)).name
    return f"{base}-{spec.split}"


def default_task(spec: FileSource | HFSource) -> str:
    """The task name used when ``task`` is not set."""
    if spec.task:
        return spec.task
    if isinstance(spec, FileSource):
        return Path(spec.path).stem
    return (spec.name or Path(str(spec.path)).stem).split("/")[-1]


def is_missing(value: Any) -> bool:
    """True for None, NaN and blank strings."""
    if value is None:
        return True
    if isinstance(value, float) and math.isnan(value):
        return True
    try:
        if pd.isna(value) is True:
            return True
    except (TypeError, ValueError):
        pass
    return isinstance(value, str) and not value.strip()


def _as_text(value: Any) -> str:
    """Cell value as text; integral floats lose their ``.0``."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        with contextlib.suppress(ValueError, TypeError):
            return _as_text(value.item())
    return str(value).strip()


def parse_gold_answer(text: str, answer_format: str = "auto") -> tuple[str | None, str | None]:
    """Gold answer and (for GSM8K-style solutions) the full solution text.

    ``"gsm8k"``: the text after the last ``####`` with commas stripped, then normalised; ``None``
    if there is no ``####``. ``"auto"``: like gsm8k when ``####`` is present, else ``"raw"``.
    ``"raw"``: the normalised text (:func:`qerl.data.schema.normalize_answer`).
    """
    if answer_format in ("gsm8k", "auto") and "####" in text:
        final = text.rsplit("####", 1)[1].strip().replace(",", "")
        return (normalize_answer(final) or None), text
    if answer_format == "gsm8k":
        return None, text
    return (normalize_answer(text) or None), None


def render_rows(rows: pd.DataFrame, template: PromptTemplate | None = None) -> pd.DataFrame:
    """Fill ``prompt`` and ``messages`` from ``question`` with ``template`` (default ``plain``)."""
    tmpl = template or NAMED_TEMPLATES["plain"]
    msgs = [tmpl.messages(q) for q in rows[COL_QUESTION].tolist()]
    out = rows.copy()
    out[COL_MESSAGES] = [json.dumps(m, ensure_ascii=False) for m in msgs]
    out[COL_PROMPT] = [tmpl.render(q) for q in rows[COL_QUESTION].tolist()]
    return out[list(PROMPT_COLUMNS)]


# --------------------------------------------------------------------------------- input checks


def check_not_empty(raw: pd.DataFrame, field: str, what: str) -> None:
    """Refuse a table with no rows: ``<field>: <what> is empty (0 rows)``."""
    if len(raw) == 0:
        raise QerlConfigError(
            field,
            f"{what} is empty (0 rows)",
            "point it at a file / dataset that holds question/answer rows",
        )


def _kind_of(value: Any) -> str:
    """How a cell value is described in errors (``list`` for arrays, lists and tuples)."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return "list"
    if isinstance(value, Mapping):
        return "dict"
    return type(value).__name__


def _first_bad(values: pd.Series, ok: Any) -> tuple[int, Any] | None:
    """(row, value) of the first non-missing value for which ``ok`` is false, or None."""
    for i, v in enumerate(values.tolist()):
        if not ok(v) and not is_missing(v):
            return i, v
    return None


def _is_text(value: Any) -> bool:
    return isinstance(value, str)


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, bool, int, float, Decimal, np.generic)) and np.ndim(value) == 0


def check_columns(raw: pd.DataFrame, spec: FileSource | HFSource, field: str, what: str) -> None:
    """Check the configured columns exist and hold usable values, before any row is converted.

    Questions must be text and answers scalars (text or a number): a numeric question column
    or a column of lists is refused (naming the column, the dtype found and the fix) instead of
    being silently stringified.
    """
    available = [str(c) for c in raw.columns]
    for opt in ("question_column", "answer_column", "id_column"):
        col = getattr(spec, opt)
        if col is not None and col not in raw.columns:
            raise QerlConfigError(
                f"{field}.{opt}",
                f"column {col!r} not found in {what}; available columns: {available}"
                f"{close_names(col, available)}",
                f"set {field}.{opt} to one of the available columns",
            )
    checks = (
        (
            "question_column",
            _is_text,
            "text",
            "store the questions as strings, or point "
            "question_column at the column that holds the question text",
        ),
        (
            "answer_column",
            _is_scalar,
            "scalars (text or a number)",
            "give one answer per row as "
            "text or a number (pick or join the list's items when writing the file)",
        ),
    )
    for opt, ok, want, fix in checks:
        col = getattr(spec, opt)
        bad = _first_bad(raw[col], ok)
        if bad is not None:
            row, value = bad
            raise QerlConfigError(
                f"{field}.{opt}",
                f"column {col!r} of {what} has dtype {raw[col].dtype} holding {_kind_of(value)} "
                f"values (row {row}: {str(value)[:60]!r}); it must hold {want}",
                fix,
            )
    if spec.id_column is not None:
        ids = raw[spec.id_column]
        dup = ids[ids.duplicated()].tolist()
        if dup:
            raise QerlConfigError(
                f"{field}.id_column",
                f"column {spec.id_column!r} has duplicate values, e.g. {dup[:3]}",
                "use a column with unique values, or unset id_column to use row numbers",
            )


# --------------------------------------------------------------------------------- conversion


def records_to_table(
    raw: pd.DataFrame,
    spec: FileSource | HFSource,
    field: str,
    origin: Mapping[str, Any],
    template: PromptTemplate | None,
    what: str,
) -> pd.DataFrame:
    """Convert a raw question/answer table into the schema (dropping unusable rows, count logged).

    Args:
        raw: the table as read.
        spec: the file / HF source it came from (columns, answer format, ids, task).
        field: parameter path of the source, used in errors and the drop log line.
        origin: where the rows came from, stored in each row's metadata.
        template: the prompt template.
        what: how the input is named in errors (e.g. the file path).

    Raises:
        QerlConfigError: an empty table, a missing or unusable column, or no usable row left.
    """
    check_columns(raw, spec, field, what)
    prefix, task = default_id_prefix(spec), default_task(spec)
    records = raw.to_dict(orient="records")
    rows: list[dict[str, str]] = []
    dropped = {"empty question": 0, "empty answer": 0, "no '####' in answer": 0}
    for i, rec in enumerate(records):
        q, a = rec[spec.question_column], rec[spec.answer_column]
        if is_missing(q):
            dropped["empty question"] += 1
            continue
        if is_missing(a):
            dropped["empty answer"] += 1
            continue
        answer, solution = parse_gold_answer(_as_text(a), spec.answer_format)
        if answer is None:
            key = "no '####' in answer" if spec.answer_format == "gsm8k" else "empty answer"
            dropped[key] += 1
            continue
        row_key = _as_text(rec[spec.id_column]) if spec.id_column is not None else str(i)
        clean = {
            str(k): (None if is_missing(v) and not isinstance(v, str) else v)
            for k, v in rec.items()
        }
        meta: dict[str, Any] = {"row": clean, "origin": {**origin, "row": i}}
        if solution is not None:
            meta["solution"] = solution
        rows.append(
            {
                COL_ID: f"{prefix}:{row_key}",
                COL_QUESTION: q.strip(),
                COL_ANSWER: answer,
                COL_TASK: task,
                COL_SOURCE: spec.kind,
                COL_METADATA: to_json(meta),
            }
        )
    n_dropped = sum(dropped.values())
    if n_dropped:
        detail = ", ".join(f"{n} {why}" for why, n in dropped.items() if n)
        logger.warning("%s: dropped %d of %d rows (%s)", field, n_dropped, len(records), detail)
    if not rows:
        raise QerlConfigError(
            field,
            f"no usable rows out of {len(records)} in {what} (columns {spec.question_column!r} / "
            f"{spec.answer_column!r}; dropped: {dropped})",
            "check the column names and answer_format, and that the rows are not blank",
        )
    return render_rows(pd.DataFrame(rows), template)
