"""Local question/answer files (``kind: file``): JSONL, JSON, Parquet and CSV."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from qerl.data.rows import check_not_empty, records_to_table
from qerl.data.schema import SOURCE_FILE
from qerl.data.specs import FileSource, parse_source
from qerl.data.templates import PromptTemplate
from qerl.errors import QerlConfigError

# pandas 3 no longer converts dates once dtype=False, and deprecates convert_dates.
_JSON_KW: dict[str, Any] = {"dtype": False}
if int(pd.__version__.split(".")[0]) < 3:
    _JSON_KW["convert_dates"] = False


def read_table(path: Path, fmt: str, field: str) -> pd.DataFrame:
    """Read a local file into a DataFrame, keeping text as text (CSV cells stay strings).

    A zero-byte file reads as an empty table; a file pandas cannot parse raises
    :class:`QerlConfigError` naming ``<field>.path``.
    """
    if path.stat().st_size == 0:
        return pd.DataFrame()
    try:
        if fmt == "jsonl":
            return pd.read_json(path, lines=True, **_JSON_KW)
        if fmt == "json":
            try:
                return pd.read_json(path, **_JSON_KW)
            except ValueError:
                return pd.read_json(path, lines=True, **_JSON_KW)
        if fmt == "parquet":
            return pd.read_parquet(path)
        return pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
    except Exception as exc:
        raise QerlConfigError(
            f"{field}.path",
            f"could not read {str(path)!r} as {fmt}: {type(exc).__name__}: {exc}",
            f"check the file contents or set {field}.format",
        ) from exc


def load_file(
    spec: FileSource | Mapping[str, Any],
    template: PromptTemplate | None = None,
    *,
    field_name: str = "data.sources[0]",
) -> pd.DataFrame:
    """Load a JSONL / JSON / Parquet / CSV question-answer file as a prompt table.

    Rows with an empty / NaN question or answer are dropped (count logged). A missing or empty
    file, a missing column, non-text questions, non-scalar answers or no usable row raise
    :class:`QerlConfigError` naming the field.
    """
    raw_spec = {"kind": SOURCE_FILE, **spec} if isinstance(spec, Mapping) else spec
    parsed = parse_source(raw_spec, field_name)
    assert isinstance(parsed, FileSource)
    path = Path(parsed.path).expanduser()
    raw = read_table(path, parsed.file_format, field_name)
    check_not_empty(raw, f"{field_name}.path", str(path))
    origin = {"kind": SOURCE_FILE, "path": str(path)}
    return records_to_table(raw, parsed, field_name, origin, template, str(path))
