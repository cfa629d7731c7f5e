"""The one prompt-table schema shared by every stage (prompt prep, rollouts, rewards, evaluation).

A prompt table is a :class:`pandas.DataFrame` with one row per prompt and (at least) these columns,
all of them plain Python ``str`` values (never NaN / None):

=========== ================================================================================
column      meaning
=========== ================================================================================
``id``      Stable, unique identifier. Built from the source (task name + generator seed +
            config hash for reasoning-gym, file stem or dataset name for files / HF datasets,
            or a user ``id_prefix``) and the row's index *in the source* (or the source's own
            id column), so it does not depend on the template, filtering or the split.
``prompt``  The rendered prompt text (template applied) for models without a chat template:
            the system prompt and the user message joined by a blank line
            (:func:`qerl.data.templates.render_plain`).
``messages`` JSON list of chat messages ``[{"role": ..., "content": ...}, ...]``: the system
            prompt (if any) then the user message. Chat models render it with
            ``tokenizer.apply_chat_template`` (:func:`qerl.data.templates.render_for_tokenizer`).
``question`` The raw question, before any template.
``answer``  The gold answer, normalised (e.g. the number after ``####`` for GSM8K, commas
            stripped). May be ``""`` for procedural tasks whose verifier needs no single answer
            (e.g. some reasoning-gym puzzles); reward functions treat that as "not applicable".
``task``    Task name (reasoning-gym dataset name, or the file / dataset's configured task).
``source``  Where the row came from: ``"reasoning_gym"``, ``"file"`` or ``"hf"``.
``metadata`` JSON object with whatever is needed to re-score the row later without the source
            object. For reasoning-gym: ``{"entry": {question, answer, metadata},
            "reasoning_gym": {name, config, seed, size, index}}``; for files / HF datasets:
            ``{"row": {...the original row...}, "origin": {...}}`` (plus ``"solution"`` when
            the answer was parsed from a GSM8K-style ``#### 42`` solution).
=========== ================================================================================

"Normalised" means :func:`normalize_answer`: surrounding whitespace, ``\\boxed{}``, ``$`` signs and
trailing periods removed, inner whitespace collapsed, and numbers put in canonical form
(``"1,000"`` -> ``"1000"``, ``"42.0"`` -> ``"42"``, ``"0.50"`` -> ``"0.5"``). Reward functions
compare answers with the same function.

Extra columns are allowed (downstream tables such as rollouts extend this one); the columns above
are required. :func:`validate_prompt_table` checks a table against this schema.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation

import pandas as pd

from qerl.errors import QerlConfigError

COL_ID = "id"
COL_PROMPT = "prompt"
COL_MESSAGES = "messages"
COL_QUESTION = "question"
COL_ANSWER = "answer"
COL_TASK = "task"
COL_SOURCE = "source"
COL_METADATA = "metadata"

#: Required columns, in canonical order.
PROMPT_COLUMNS: tuple[str, ...] = (
    COL_ID,
    COL_PROMPT,
    COL_MESSAGES,
    COL_QUESTION,
    COL_ANSWER,
    COL_TASK,
    COL_SOURCE,
    COL_METADATA,
)

SOURCE_REASONING_GYM = "reasoning_gym"
SOURCE_FILE = "file"
SOURCE_HF = "hf"
#: Allowed values of the ``source`` column.
SOURCE_KINDS: tuple[str, ...] = (SOURCE_REASONING_GYM, SOURCE_FILE, SOURCE_HF)

#: Columns that must not be empty strings.
_NON_EMPTY = (COL_ID, COL_PROMPT, COL_QUESTION, COL_TASK)


_BOXED = re.compile(r"\\boxed\{(.*)\}", re.DOTALL)
_GROUPED_NUMBER = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def normalize_number(text: str) -> str | None:
    """Canonical form of a number written as text, or None if ``text`` is not a plain number.

    Thousands separators are removed (``"1,234.50"`` -> ``"1234.5"``), integral values lose their
    decimals (``"42.0"`` -> ``"42"``, ``"-0"`` -> ``"0"``) and ``+`` signs are dropped.
    """
    s = text.strip()
    if _GROUPED_NUMBER.fullmatch(s):
        s = s.replace(",", "")
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        d = Decimal(s)
    except InvalidOperation:  # pragma: no cover - the regex only admits valid decimals
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def normalize_answer(text: str) -> str:
    """Normalise an answer for comparison (the schema's meaning of "normalised").

    Strips whitespace, a surrounding ``\\boxed{...}``, ``$`` signs and trailing periods, collapses
    inner whitespace, and canonicalises plain numbers with :func:`normalize_number`. Case is kept.
    """
    s = str(text).strip()
    boxed = _BOXED.fullmatch(s)
    if boxed:
        s = boxed.group(1)
    s = s.strip().strip("$").strip().rstrip(".").strip()
    s = " ".join(s.split())
    number = normalize_number(s)
    return s if number is None else number


def empty_prompt_table() -> pd.DataFrame:
    """Return an empty table with the schema's columns (all of ``str`` dtype)."""
    return pd.DataFrame({c: pd.Series([], dtype=object).astype(str) for c in PROMPT_COLUMNS})


def _first_bad(values: list[object], check: Callable[[object], bool]) -> int | None:
    """Index of the first value for which ``check`` is false, or None."""
    for i, v in enumerate(values):
        if not check(v):
            return i
    return None


def _is_json_messages(v: object) -> bool:
    """True if ``v`` is a JSON string holding a list of {role, content} string dicts."""
    try:
        msgs = json.loads(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return isinstance(msgs, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in msgs
    )


def _is_json_object(v: object) -> bool:
    """True if ``v`` is a JSON string holding an object."""
    try:
        return isinstance(json.loads(v), dict)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def validate_prompt_table(df: pd.DataFrame, name: str = "prompt_table") -> pd.DataFrame:
    """Check that ``df`` follows the prompt-table schema and return it unchanged.

    Checks: every required column is present; every value of a required column is a ``str``;
    ``id``, ``prompt``, ``question`` and ``task`` are non-empty; ids are unique; ``source`` is one of
    :data:`SOURCE_KINDS`; ``messages`` is a JSON list of ``{role, content}`` and ``metadata`` a JSON
    object.

    Args:
        df: the table to check.
        name: how the table is named in error messages (the dataset or parameter name).

    Raises:
        QerlConfigError: naming ``<name>.<column>`` and the first offending row.
    """
    if not isinstance(df, pd.DataFrame):
        raise QerlConfigError(
            name, f"expected a pandas DataFrame, got {type(df).__name__}", "pass a prompt table"
        )
    missing = [c for c in PROMPT_COLUMNS if c not in df.columns]
    if missing:
        raise QerlConfigError(
            name,
            f"missing column(s) {missing}; present: {list(df.columns)}",
            "build it with qerl.data.sources.build_prompt_tables or add the columns",
        )
    for col in PROMPT_COLUMNS:
        values = df[col].tolist()
        bad = _first_bad(values, lambda v: isinstance(v, str))
        if bad is not None:
            raise QerlConfigError(
                f"{name}.{col}",
                f"row {bad} holds {values[bad]!r} ({type(values[bad]).__name__}), not a string",
                "store every schema column as str (JSON-encode structured values)",
            )
    for col in _NON_EMPTY:
        values = df[col].tolist()
        bad = _first_bad(values, lambda v: str(v).strip() != "")
        if bad is not None:
            raise QerlConfigError(f"{name}.{col}", f"row {bad} is empty", "drop or fill empty rows")
    dup = df[COL_ID][df[COL_ID].duplicated()].tolist()
    if dup:
        raise QerlConfigError(
            f"{name}.{COL_ID}",
            f"{len(dup)} duplicate id(s), e.g. {dup[:3]}",
            "give each source a distinct id_prefix and make source id columns unique",
        )
    checks = (
        (COL_SOURCE, lambda v: v in SOURCE_KINDS, f"is not one of {SOURCE_KINDS}"),
        (COL_MESSAGES, _is_json_messages, "is not a JSON list of {role, content} messages"),
        (COL_METADATA, _is_json_object, "is not a JSON object"),
    )
    for col, check, what in checks:
        values = df[col].tolist()
        bad = _first_bad(values, check)
        if bad is not None:
            raise QerlConfigError(
                f"{name}.{col}",
                f"row {bad} ({str(values[bad])[:60]!r}) {what}",
                "build the table with qerl.data.sources",
            )
    return df
