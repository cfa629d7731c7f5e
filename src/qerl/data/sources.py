"""Prompt sources: reasoning-gym generators, local files and Hugging Face datasets.

Every loader returns a DataFrame in the prompt-table schema (:mod:`qerl.data.schema`).
:func:`build_prompt_tables` is the entry point the pipeline uses: it validates *all* source
parameters first (cheap), then loads, renders, filters and splits into train / eval tables.

Source parameters (``data.sources`` is a list of mappings; ``kind`` defaults to ``reasoning_gym``):

* ``kind: reasoning_gym`` -- ``name`` (a reasoning-gym dataset), ``size`` (default 100),
  ``seed`` (default 0), ``config`` (the generator's own options). The full entry (question,
  answer, metadata) and the generator parameters are stored in ``metadata`` so the row can be
  re-scored later by reasoning-gym's verifier without this object.
* ``kind: file`` -- ``path`` to ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` (or ``format``),
  ``question_column`` / ``answer_column`` (default ``question`` / ``answer``), optional
  ``id_column`` and ``task``. GSM8K solutions (``"... #### 1,234"``) are understood: the answer is
  the text after ``####``, commas stripped (``answer_format``: ``auto`` | ``gsm8k`` | ``raw``).
* ``kind: hf`` -- either ``path`` (a ``save_to_disk`` directory, a directory of data files or one
  data file) or ``name`` (a dataset already in the local HF cache; never downloaded), ``subset``,
  ``split`` (default ``train``), ``data_files``, ``cache_dir``, plus the column options of files.

Every kind also takes ``id_prefix`` (ids are ``<id_prefix>:<row>``) and ``use``: ``both``
(default; split into train and eval), ``train`` or ``eval`` (all rows go to that table, e.g. a
GSM8K test file as the eval set).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    SOURCE_FILE,
    SOURCE_HF,
    SOURCE_REASONING_GYM,
    empty_prompt_table,
    normalize_answer,
    validate_prompt_table,
)
from qerl.data.templates import NAMED_TEMPLATES, PromptTemplate, get_template
from qerl.errors import QerlConfigError

logger = logging.getLogger(__name__)

FILE_FORMATS: dict[str, str] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".csv": "csv",
}
ANSWER_FORMATS: tuple[str, ...] = ("auto", "gsm8k", "raw")
USES: tuple[str, ...] = ("both", "train", "eval")
#: Files that mark a ``save_to_disk`` directory (DatasetDict / Dataset).
_SAVED_MARKERS = ("dataset_dict.json", "state.json")
_HF_BUILDERS = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}


# --------------------------------------------------------------------------------------------
# Source specs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReasoningGymSource:
    """A reasoning-gym procedural generator (``kind: reasoning_gym``)."""

    name: str
    size: int = 100
    seed: int = 0
    config: Mapping[str, Any] = field(default_factory=dict)
    id_prefix: str | None = None
    use: str = "both"
    kind: str = SOURCE_REASONING_GYM


@dataclass(frozen=True)
class FileSource:
    """A local JSONL / JSON / Parquet / CSV file (``kind: file``)."""

    path: str
    question_column: str = "question"
    answer_column: str = "answer"
    id_column: str | None = None
    task: str | None = None
    format: str | None = None
    answer_format: str = "auto"
    id_prefix: str | None = None
    use: str = "both"
    kind: str = SOURCE_FILE


@dataclass(frozen=True)
class HFSource:
    """A Hugging Face ``datasets`` dataset from a local path or the local cache (``kind: hf``)."""

    path: str | None = None
    name: str | None = None
    subset: str | None = None
    split: str = "train"
    data_files: str | list[str] | None = None
    cache_dir: str | None = None
    question_column: str = "question"
    answer_column: str = "answer"
    id_column: str | None = None
    task: str | None = None
    answer_format: str = "auto"
    id_prefix: str | None = None
    use: str = "both"
    kind: str = SOURCE_HF


SourceSpec = ReasoningGymSource | FileSource | HFSource
_SPEC_CLASSES: dict[str, type] = {
    SOURCE_REASONING_GYM: ReasoningGymSource,
    SOURCE_FILE: FileSource,
    SOURCE_HF: HFSource,
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    SOURCE_REASONING_GYM: ("name",),
    SOURCE_FILE: ("path",),
    SOURCE_HF: (),
}
_STR_FIELDS = (
    "name",
    "path",
    "subset",
    "split",
    "cache_dir",
    "question_column",
    "answer_column",
    "id_column",
    "task",
    "format",
    "answer_format",
    "id_prefix",
    "use",
)


def _close(word: str, choices: Sequence[str], n: int = 5) -> str:
    """'did you mean' text for ``word`` among ``choices`` (empty if nothing is close)."""
    close = difflib.get_close_matches(word, list(choices), n=n, cutoff=0.5)
    return f"; close names: {close}" if close else ""


def _check_int(value: Any, fld: str, minimum: int | None = None) -> None:
    """Raise unless ``value`` is an int (not a bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise QerlConfigError(fld, f"expected an integer, got {value!r}", "give a whole number")
    if minimum is not None and value < minimum:
        raise QerlConfigError(fld, f"must be >= {minimum}, got {value}", f"use {minimum} or more")


def _rg_registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's dataset registry: name -> (dataset class, config class)."""
    from reasoning_gym.factory import DATASETS

    return DATASETS


def _validate_rg(spec: ReasoningGymSource, fld: str) -> None:
    """Check task name, size, seed and config (constructing the config, not the data)."""
    registry = _rg_registry()
    if spec.name not in registry:
        raise QerlConfigError(
            f"{fld}.name",
            f"unknown reasoning-gym task {spec.name!r}{_close(spec.name, sorted(registry))}",
            f"use one of the {len(registry)} registered tasks "
            "(reasoning_gym.factory.DATASETS), e.g. basic_arithmetic, countdown, chain_sum",
        )
    _check_int(spec.size, f"{fld}.size", 1)
    _check_int(spec.seed, f"{fld}.seed")
    if not isinstance(spec.config, Mapping):
        raise QerlConfigError(
            f"{fld}.config",
            f"expected a mapping, got {type(spec.config).__name__}",
            "give the generator options as key: value pairs",
        )
    clash = sorted({"size", "seed"} & set(spec.config))
    if clash:
        raise QerlConfigError(
            f"{fld}.config.{clash[0]}",
            "set inside config; it belongs to the source itself",
            f"move {clash[0]} up to {fld}.{clash[0]}",
        )
    config_cls = registry[spec.name][1]
    allowed = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("size", "seed")]
    unknown = [k for k in spec.config if k not in allowed]
    if unknown:
        raise QerlConfigError(
            f"{fld}.config.{unknown[0]}",
            f"not an option of reasoning-gym task {spec.name!r}{_close(unknown[0], allowed)}",
            f"use only {allowed}",
        )
    try:
        cfg = config_cls(**dict(spec.config), size=spec.size, seed=spec.seed)
        if hasattr(cfg, "validate"):
            cfg.validate()
    except Exception as exc:  # config classes raise AssertionError / ValueError / TypeError
        raise QerlConfigError(
            f"{fld}.config",
            f"rejected by reasoning-gym {spec.name!r}: {type(exc).__name__}: {exc}",
            f"fix the generator options (allowed: {allowed})",
        ) from exc


def _check_answer_format_and_use(spec: FileSource | HFSource, fld: str) -> None:
    """Shared checks of the column / answer options of file and HF sources."""
    if spec.answer_format not in ANSWER_FORMATS:
        raise QerlConfigError(
            f"{fld}.answer_format",
            f"unknown value {spec.answer_format!r}",
            f"use one of {list(ANSWER_FORMATS)}",
        )
    for col in ("question_column", "answer_column"):
        if not getattr(spec, col):
            raise QerlConfigError(f"{fld}.{col}", "is empty", "name the column holding it")


def _file_format(spec: FileSource, fld: str) -> str:
    """The file's format: ``spec.format`` or inferred from the suffix."""
    if spec.format is not None:
        fmt = spec.format.lower().lstrip(".")
        if fmt not in set(FILE_FORMATS.values()):
            raise QerlConfigError(
                f"{fld}.format",
                f"unsupported format {spec.format!r}",
                f"use one of {sorted(set(FILE_FORMATS.values()))}",
            )
        return fmt
    suffix = Path(spec.path).suffix.lower()
    if suffix not in FILE_FORMATS:
        raise QerlConfigError(
            f"{fld}.path",
            f"cannot tell the format of {spec.path!r} from its suffix {suffix!r}",
            f"use a file ending in {sorted(FILE_FORMATS)} or set {fld}.format",
        )
    return FILE_FORMATS[suffix]


def _validate_file(spec: FileSource, fld: str) -> None:
    """Check that the file exists and its format and options are known."""
    path = Path(spec.path).expanduser()
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise QerlConfigError(
            f"{fld}.path",
            f"{str(path)!r} {what}",
            "point it at an existing .jsonl/.json/.parquet/.csv file (relative paths are "
            "resolved from the working directory, usually the project root)",
        )
    _file_format(spec, fld)
    _check_answer_format_and_use(spec, fld)


def _validate_hf(spec: HFSource, fld: str) -> None:
    """Check that exactly one of path / name is given and that a path exists."""
    if (spec.path is None) == (spec.name is None):
        raise QerlConfigError(
            fld,
            "give exactly one of `path` and `name`",
            "set path to a local dataset directory or file, or name to a dataset in the "
            "local Hugging Face cache",
        )
    if spec.path is not None and not Path(spec.path).expanduser().exists():
        raise QerlConfigError(
            f"{fld}.path",
            f"{spec.path!r} does not exist",
            "point it at a save_to_disk directory, a directory of data files or a data file",
        )
    if not spec.split:
        raise QerlConfigError(f"{fld}.split", "is empty", "name a split, e.g. train or test")
    _check_answer_format_and_use(spec, fld)


def parse_source(
    raw: Mapping[str, Any] | SourceSpec, field_name: str = "data.sources[0]"
) -> SourceSpec:
    """Turn one source parameter mapping into a validated spec (no data is loaded).

    Args:
        raw: the mapping from parameters (``kind`` defaults to ``reasoning_gym``), or a spec.
        field_name: parameter path of this source, used in error messages.

    Raises:
        QerlConfigError: unknown kind or key, missing required key, wrong type, unknown
            reasoning-gym task or option, missing file, bad format option.
    """
    if isinstance(raw, (ReasoningGymSource, FileSource, HFSource)):
        spec: SourceSpec = raw
    else:
        if not isinstance(raw, Mapping):
            raise QerlConfigError(
                field_name,
                f"expected a mapping, got {type(raw).__name__}",
                "give each source as key: value pairs with a `kind`",
            )
        kind = raw.get("kind", SOURCE_REASONING_GYM)
        if kind not in _SPEC_CLASSES:
            raise QerlConfigError(
                f"{field_name}.kind",
                f"unknown source kind {kind!r}",
                f"use one of {sorted(_SPEC_CLASSES)}",
            )
        cls = _SPEC_CLASSES[kind]
        allowed = [f.name for f in dataclasses.fields(cls)]
        for key in raw:
            if key not in allowed:
                raise QerlConfigError(
                    f"{field_name}.{key}",
                    f"not an option of a {kind} source{_close(str(key), allowed)}",
                    f"use only {allowed}",
                )
        for key in _REQUIRED[kind]:
            if raw.get(key) in (None, ""):
                raise QerlConfigError(
                    f"{field_name}.{key}", "is required", f"set {key} for this {kind} source"
                )
        spec = cls(**dict(raw))
    for key in _STR_FIELDS:
        value = getattr(spec, key, None)
        if value is not None and not isinstance(value, str):
            raise QerlConfigError(
                f"{field_name}.{key}", f"expected a string, got {value!r}", "quote the value"
            )
    if spec.use not in USES:
        raise QerlConfigError(
            f"{field_name}.use", f"unknown value {spec.use!r}", f"use one of {list(USES)}"
        )
    if isinstance(spec, ReasoningGymSource):
        _validate_rg(spec, field_name)
    elif isinstance(spec, FileSource):
        _validate_file(spec, field_name)
    else:
        _validate_hf(spec, field_name)
    return spec


def parse_sources(
    raw: Sequence[Mapping[str, Any] | SourceSpec], field_name: str = "data.sources"
) -> list[SourceSpec]:
    """Validate every source of ``data.sources`` (see :func:`parse_source`) before any loading."""
    if isinstance(raw, (str, bytes, Mapping)) or not isinstance(raw, Sequence):
        raise QerlConfigError(
            field_name,
            f"expected a list of sources, got {type(raw).__name__}",
            "give a list, e.g. [{kind: reasoning_gym, name: basic_arithmetic, size: 200}]",
        )
    if not raw:
        raise QerlConfigError(
            field_name, "is empty", "list at least one reasoning_gym, file or hf source"
        )
    return [parse_source(r, f"{field_name}[{i}]") for i, r in enumerate(raw)]


# --------------------------------------------------------------------------------------------
# Row helpers
# --------------------------------------------------------------------------------------------


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


def default_id_prefix(spec: SourceSpec) -> str:
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


def _default_task(spec: FileSource | HFSource) -> str:
    """The task name used when ``task`` is not set."""
    if spec.task:
        return spec.task
    if isinstance(spec, FileSource):
        return Path(spec.path).stem
    return (spec.name or Path(str(spec.path)).stem).split("/")[-1]


def _is_missing(value: Any) -> bool:
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


def _records_to_table(
    raw: pd.DataFrame,
    spec: FileSource | HFSource,
    fld: str,
    source: str,
    origin: Mapping[str, Any],
    template: PromptTemplate | None,
) -> pd.DataFrame:
    """Convert a raw question/answer table into the schema (dropping unusable rows)."""
    available = [str(c) for c in raw.columns]
    for opt in ("question_column", "answer_column", "id_column"):
        col = getattr(spec, opt)
        if col is not None and col not in raw.columns:
            raise QerlConfigError(
                f"{fld}.{opt}",
                f"column {col!r} not found; available columns: {available}{_close(col, available)}",
                f"set {fld}.{opt} to one of the available columns",
            )
    if spec.id_column is not None:
        dup = raw[spec.id_column][raw[spec.id_column].duplicated()].tolist()
        if dup:
            raise QerlConfigError(
                f"{fld}.id_column",
                f"column {spec.id_column!r} has duplicate values, e.g. {dup[:3]}",
                "use a column with unique values, or unset id_column to use row numbers",
            )
    prefix, task = default_id_prefix(spec), _default_task(spec)
    records = raw.to_dict(orient="records")
    rows: list[dict[str, str]] = []
    dropped = {"empty question": 0, "empty answer": 0, "no '####' in answer": 0}
    for i, rec in enumerate(records):
        q, a = rec[spec.question_column], rec[spec.answer_column]
        if _is_missing(q):
            dropped["empty question"] += 1
            continue
        if _is_missing(a):
            dropped["empty answer"] += 1
            continue
        answer, solution = parse_gold_answer(_as_text(a), spec.answer_format)
        if answer is None:
            key = "no '####' in answer" if spec.answer_format == "gsm8k" else "empty answer"
            dropped[key] += 1
            continue
        row_key = _as_text(rec[spec.id_column]) if spec.id_column is not None else str(i)
        clean = {
            str(k): (None if _is_missing(v) and not isinstance(v, str) else v)
            for k, v in rec.items()
        }
        meta: dict[str, Any] = {"row": clean, "origin": {**origin, "row": i}}
        if solution is not None:
            meta["solution"] = solution
        rows.append(
            {
                COL_ID: f"{prefix}:{row_key}",
                COL_QUESTION: str(q).strip(),
                COL_ANSWER: answer,
                COL_TASK: task,
                COL_SOURCE: source,
                COL_METADATA: to_json(meta),
            }
        )
    n_dropped = sum(dropped.values())
    if n_dropped:
        detail = ", ".join(f"{n} {why}" for why, n in dropped.items() if n)
        logger.warning("%s: dropped %d of %d rows (%s)", fld, n_dropped, len(records), detail)
    if not rows:
        raise QerlConfigError(
            fld,
            f"no usable rows out of {len(records)} (columns {spec.question_column!r} / "
            f"{spec.answer_column!r}; dropped: {dropped})",
            "check the column names, answer_format and that the data is not empty",
        )
    return render_rows(pd.DataFrame(rows), template)


# --------------------------------------------------------------------------------------------
# Loaders
# --------------------------------------------------------------------------------------------


def load_reasoning_gym(
    spec: ReasoningGymSource | Mapping[str, Any],
    template: PromptTemplate | None = None,
    *,
    field_name: str = "data.sources[0]",
) -> pd.DataFrame:
    """Generate ``size`` entries of a reasoning-gym task as a prompt table.

    ``answer`` is the entry's answer as text (``""`` when the task has no single answer);
    ``metadata`` holds ``{"entry": {question, answer, metadata}, "reasoning_gym": {name, config,
    seed, size, index}}`` so :func:`qerl.rewards.builtin.score_reasoning_gym` can re-score it.
    """
    spec = parse_source(spec, field_name)
    assert isinstance(spec, ReasoningGymSource)
    import reasoning_gym

    ds = reasoning_gym.create_dataset(
        spec.name, size=spec.size, seed=spec.seed, **dict(spec.config)
    )
    prefix = default_id_prefix(spec)
    gen = {"name": spec.name, "config": dict(spec.config), "seed": spec.seed, "size": spec.size}
    rows = []
    for i in range(spec.size):
        entry = ds[i]
        answer = entry.get("answer")
        full = {
            "question": entry["question"],
            "answer": answer,
            "metadata": entry.get("metadata", {}),
        }
        rows.append(
            {
                COL_ID: f"{prefix}:{i}",
                COL_QUESTION: str(entry["question"]),
                COL_ANSWER: "" if answer is None else str(answer),
                COL_TASK: spec.name,
                COL_SOURCE: SOURCE_REASONING_GYM,
                COL_METADATA: to_json({"entry": full, "reasoning_gym": {**gen, "index": i}}),
            }
        )
    return render_rows(pd.DataFrame(rows), template)


def _read_file(path: Path, fmt: str, fld: str) -> pd.DataFrame:
    """Read a local file into a DataFrame, keeping text as text."""
    try:
        if fmt == "jsonl":
            return pd.read_json(path, lines=True, dtype=False, convert_dates=False)
        if fmt == "json":
            try:
                return pd.read_json(path, dtype=False, convert_dates=False)
            except ValueError:
                return pd.read_json(path, lines=True, dtype=False, convert_dates=False)
        if fmt == "parquet":
            return pd.read_parquet(path)
        return pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
    except Exception as exc:
        raise QerlConfigError(
            f"{fld}.path",
            f"could not read {str(path)!r} as {fmt}: {type(exc).__name__}: {exc}",
            f"check the file contents or set {fld}.format",
        ) from exc


def load_file(
    spec: FileSource | Mapping[str, Any],
    template: PromptTemplate | None = None,
    *,
    field_name: str = "data.sources[0]",
) -> pd.DataFrame:
    """Load a JSONL / JSON / Parquet / CSV question-answer file as a prompt table.

    Rows with an empty / NaN question or answer are dropped (count logged); an empty result, a
    missing file or a missing column raises :class:`QerlConfigError` naming the field.
    """
    raw_spec = {"kind": SOURCE_FILE, **spec} if isinstance(spec, Mapping) else spec
    parsed = parse_source(raw_spec, field_name)
    assert isinstance(parsed, FileSource)
    path = Path(parsed.path).expanduser()
    raw = _read_file(path, _file_format(parsed, field_name), field_name)
    origin = {"kind": SOURCE_FILE, "path": str(path)}
    return _records_to_table(raw, parsed, field_name, SOURCE_FILE, origin, template)


@contextlib.contextmanager
def hf_offline() -> Iterator[None]:
    """Force ``datasets`` / ``huggingface_hub`` offline mode for the duration of the block."""
    import datasets.config as ds_config
    import huggingface_hub.constants as hub_constants

    saved = (ds_config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    ds_config.HF_HUB_OFFLINE = True
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        ds_config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _pick_split(obj: Any, spec: HFSource, fld: str) -> Any:
    """Select ``spec.split`` from a DatasetDict (a plain Dataset is returned as is)."""
    import datasets

    if isinstance(obj, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        splits = list(obj.keys())
        if spec.split not in splits:
            raise QerlConfigError(
                f"{fld}.split",
                f"no split {spec.split!r}; available splits: {splits}",
                f"set {fld}.split to one of {splits}",
            )
        return obj[spec.split]
    return obj


def _load_hf_object(spec: HFSource, fld: str) -> Any:
    """Load the dataset (never touching the network) and return the selected split."""
    import datasets

    kwargs: dict[str, Any] = {"cache_dir": spec.cache_dir}
    if spec.path is not None:
        path = Path(spec.path).expanduser()
        try:
            if path.is_dir() and any((path / f).is_file() for f in _SAVED_MARKERS):
                return _pick_split(datasets.load_from_disk(str(path)), spec, fld)
            with hf_offline():
                if path.is_file():
                    fmt = FILE_FORMATS.get(path.suffix.lower())
                    if fmt is None:
                        raise QerlConfigError(
                            f"{fld}.path",
                            f"unsupported data file {path.name!r}",
                            f"use a file ending in {sorted(FILE_FORMATS)}",
                        )
                    obj = datasets.load_dataset(_HF_BUILDERS[fmt], data_files=str(path), **kwargs)
                else:
                    obj = datasets.load_dataset(
                        str(path), name=spec.subset, data_files=spec.data_files, **kwargs
                    )
            return _pick_split(obj, spec, fld)
        except QerlConfigError:
            raise
        except Exception as exc:
            raise QerlConfigError(
                f"{fld}.path",
                f"could not load {str(path)!r}: {type(exc).__name__}: {exc}",
                "point it at a save_to_disk directory, a directory of data files or a data file",
            ) from exc
    try:
        with hf_offline():
            obj = datasets.load_dataset(spec.name, name=spec.subset, split=spec.split, **kwargs)
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise QerlConfigError(
                f"{fld}.split", f"{exc}", "set split to one of the dataset's splits"
            ) from exc
        raise _not_cached(spec, fld, exc) from exc
    except Exception as exc:
        raise _not_cached(spec, fld, exc) from exc
    return obj


def _not_cached(spec: HFSource, fld: str, exc: BaseException) -> QerlConfigError:
    """The error for a hub dataset name that is not in the local cache."""
    import datasets.config as ds_config

    cache = spec.cache_dir or ds_config.HF_DATASETS_CACHE
    return QerlConfigError(
        f"{fld}.name",
        f"dataset {spec.name!r} is not in the local Hugging Face cache ({cache}) and nothing is "
        f"ever downloaded here ({type(exc).__name__}: {str(exc)[:200]})",
        "on a machine with network run datasets.load_dataset(name).save_to_disk(DIR), copy DIR "
        f"here and set {fld}.path: DIR instead of name (or copy the HF datasets cache and set "
        f"{fld}.cache_dir)",
    )


def load_hf(
    spec: HFSource | Mapping[str, Any],
    template: PromptTemplate | None = None,
    *,
    field_name: str = "data.sources[0]",
) -> pd.DataFrame:
    """Load a Hugging Face dataset (local path or local cache only) as a prompt table."""
    raw_spec = {"kind": SOURCE_HF, **spec} if isinstance(spec, Mapping) else spec
    parsed = parse_source(raw_spec, field_name)
    assert isinstance(parsed, HFSource)
    import datasets

    bars_were_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        obj = _load_hf_object(parsed, field_name)
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    origin = {
        "kind": SOURCE_HF,
        "path": parsed.path,
        "name": parsed.name,
        "subset": parsed.subset,
        "split": parsed.split,
    }
    return _records_to_table(obj.to_pandas(), parsed, field_name, SOURCE_HF, origin, template)


def load_source(
    spec: SourceSpec | Mapping[str, Any],
    template: PromptTemplate | None = None,
    *,
    field_name: str = "data.sources[0]",
) -> pd.DataFrame:
    """Load any source kind as a prompt table (dispatch on ``kind``)."""
    parsed = parse_source(spec, field_name)
    if isinstance(parsed, ReasoningGymSource):
        return load_reasoning_gym(parsed, template, field_name=field_name)
    if isinstance(parsed, FileSource):
        return load_file(parsed, template, field_name=field_name)
    return load_hf(parsed, template, field_name=field_name)


# --------------------------------------------------------------------------------------------
# Split and build
# --------------------------------------------------------------------------------------------


def _split_key(seed: int, row_id: str) -> int:
    """Deterministic pseudo-random sort key of a row for a given seed."""
    digest = hashlib.blake2b(f"{seed}\x00{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _allocate(counts: Mapping[str, int], total: int) -> dict[str, int]:
    """Split ``total`` over groups proportionally to ``counts`` (largest remainder, stable)."""
    n = sum(counts.values())
    if n == 0 or total == 0:
        return {k: 0 for k in counts}
    exact = {k: total * c / n for k, c in counts.items()}
    quota = {k: math.floor(v) for k, v in exact.items()}
    rest = total - sum(quota.values())
    for k in sorted(counts, key=lambda k: (-(exact[k] - quota[k]), k))[:rest]:
        quota[k] += 1
    return quota


def _resolve_eval_size(
    n: int, eval_fraction: float | None, eval_size: int | None, prefix: str
) -> int:
    """Number of eval rows for a pool of ``n`` rows."""
    if eval_size is not None:
        n_eval = eval_size
        fld, what = f"{prefix}.eval_size", f"eval_size={eval_size}"
    else:
        frac = 0.1 if eval_fraction is None else eval_fraction
        n_eval = max(1, round(frac * n)) if frac > 0 and n > 1 else 0
        fld, what = f"{prefix}.eval_fraction", f"eval_fraction={frac}"
    if n_eval >= n > 0:
        raise QerlConfigError(
            fld,
            f"{what} leaves no training prompts out of {n}",
            "lower it or add more data (or mark a source with use: eval)",
        )
    return n_eval


def split_train_eval(
    df: pd.DataFrame,
    *,
    eval_fraction: float | None = None,
    eval_size: int | None = None,
    seed: int = 0,
    prefix: str = "data",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Deterministic train / eval split, stratified by ``task``.

    Each row gets a key hashed from ``(seed, id)``; per task, the rows with the smallest keys go
    to eval, in numbers proportional to the task's share of ``eval_size`` (or ``eval_fraction`` of
    the rows, default 0.1). The same seed always gives the same split (independent of row order),
    a different seed a different one. Both outputs are ordered by key (a seeded shuffle).
    """
    keyed = df.assign(_key=[_split_key(seed, i) for i in df[COL_ID].tolist()])
    keyed = keyed.sort_values(["_key", COL_ID], kind="stable")
    n_eval = _resolve_eval_size(len(keyed), eval_fraction, eval_size, prefix)
    counts = keyed.groupby(COL_TASK, sort=True).size().to_dict()
    quota = _allocate({str(k): int(v) for k, v in counts.items()}, n_eval)
    rank = keyed.groupby(COL_TASK, sort=False).cumcount()
    is_eval = [r < quota[t] for r, t in zip(rank.tolist(), keyed[COL_TASK].tolist(), strict=True)]
    mask = pd.Series(is_eval, index=keyed.index)
    train = keyed[~mask].drop(columns="_key").reset_index(drop=True)
    evals = keyed[mask].drop(columns="_key").reset_index(drop=True)
    return train, evals


def _check_build_params(
    eval_fraction: float | None,
    eval_size: int | None,
    seed: int,
    max_prompts: int | None,
    max_prompt_chars: int | None,
    prefix: str,
) -> None:
    """Validate the scalar options of :func:`build_prompt_tables`."""
    if eval_fraction is not None and eval_size is not None:
        raise QerlConfigError(
            f"{prefix}.eval_size",
            "set together with eval_fraction",
            "set only one of eval_fraction and eval_size",
        )
    if eval_fraction is not None and (
        isinstance(eval_fraction, bool)
        or not isinstance(eval_fraction, (int, float))
        or not 0 <= eval_fraction < 1
    ):
        raise QerlConfigError(
            f"{prefix}.eval_fraction",
            f"must be a number in [0, 1), got {eval_fraction!r}",
            "use e.g. 0.1 for 10% of the prompts",
        )
    if eval_size is not None:
        _check_int(eval_size, f"{prefix}.eval_size", 0)
    _check_int(seed, f"{prefix}.seed")
    if max_prompts is not None:
        _check_int(max_prompts, f"{prefix}.max_prompts", 1)
    if max_prompt_chars is not None:
        _check_int(max_prompt_chars, f"{prefix}.max_prompt_chars", 1)


def _check_unique_ids(tables: Sequence[pd.DataFrame], prefix: str) -> None:
    """Raise if two sources produce the same id (same id_prefix)."""
    seen: dict[str, int] = {}
    for i, table in enumerate(tables):
        for row_id in table[COL_ID].tolist():
            j = seen.setdefault(row_id, i)
            if j != i:
                raise QerlConfigError(
                    f"{prefix}.sources[{i}].id_prefix",
                    f"id {row_id!r} is produced by sources[{j}] too (same id prefix)",
                    f"give {prefix}.sources[{i}] a distinct id_prefix (or remove the duplicate)",
                )


def build_prompt_tables(
    sources: Sequence[Mapping[str, Any] | SourceSpec],
    template: str | PromptTemplate = "qerl",
    system_prompt: str | None = None,
    *,
    eval_fraction: float | None = None,
    eval_size: int | None = None,
    seed: int = 0,
    max_prompts: int | None = None,
    max_prompt_chars: int | None = None,
    prefix: str = "data",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Load every source, render prompts, filter and split into ``(train_df, eval_df)``.

    Args:
        sources: ``data.sources`` (see the module docstring); all are validated before loading.
        template: ``data.template`` (``"qerl"``, ``"plain"`` or a string with ``{question}``).
        system_prompt: ``data.system_prompt``; overrides the template's (``""`` for none).
        eval_fraction: share of the ``use: both`` rows held out (default 0.1 if neither is set).
        eval_size: exact number of held-out rows (instead of ``eval_fraction``).
        seed: split seed; same seed -> same split.
        max_prompts: cap on the number of *training* prompts (eval is drawn first, so the cap
            never changes the eval set).
        max_prompt_chars: drop rows whose rendered ``prompt`` is longer (count logged).
        prefix: parameter path of these options, used in error messages.

    Returns:
        Train and eval tables in the prompt-table schema, each ordered by a seeded shuffle.

    Raises:
        QerlConfigError: for any bad option or source, naming the parameter.
    """
    tmpl = get_template(
        template, system_prompt, field=f"{prefix}.template", system_field=f"{prefix}.system_prompt"
    )
    _check_build_params(eval_fraction, eval_size, seed, max_prompts, max_prompt_chars, prefix)
    specs = parse_sources(sources, f"{prefix}.sources")
    tables = [
        load_source(s, tmpl, field_name=f"{prefix}.sources[{i}]") for i, s in enumerate(specs)
    ]
    _check_unique_ids(tables, prefix)
    uses = [pd.Series([s.use] * len(t), dtype=object) for s, t in zip(specs, tables, strict=True)]
    df = pd.concat(tables, ignore_index=True)
    use = pd.concat(uses, ignore_index=True)
    if max_prompt_chars is not None:
        keep = df[COL_PROMPT].str.len() <= max_prompt_chars
        if not keep.all():
            logger.warning(
                "%s.max_prompt_chars: dropped %d of %d prompts longer than %d characters",
                prefix,
                int((~keep).sum()),
                len(df),
                max_prompt_chars,
            )
        if not keep.any():
            raise QerlConfigError(
                f"{prefix}.max_prompt_chars",
                f"every prompt is longer than {max_prompt_chars} characters "
                f"(shortest: {int(df[COL_PROMPT].str.len().min())})",
                "raise max_prompt_chars or use a shorter template / system prompt",
            )
        df, use = df[keep].reset_index(drop=True), use[keep].reset_index(drop=True)
    pool = df[use == "both"].reset_index(drop=True)
    train, evals = empty_prompt_table(), empty_prompt_table()
    if len(pool):
        train, evals = split_train_eval(
            pool, eval_fraction=eval_fraction, eval_size=eval_size, seed=seed, prefix=prefix
        )
    extra_train = df[use == "train"]
    extra_eval = df[use == "eval"]
    if len(extra_train):
        train, _ = split_train_eval(pd.concat([train, extra_train]), eval_size=0, seed=seed)
    if len(extra_eval):
        evals, _ = split_train_eval(pd.concat([evals, extra_eval]), eval_size=0, seed=seed)
    if train.empty:
        raise QerlConfigError(
            f"{prefix}.sources",
            "no training prompts (every source has use: eval)",
            "add a source with use: both or use: train",
        )
    if max_prompts is not None and len(train) > max_prompts:
        logger.info(
            "%s.max_prompts: kept %d of %d training prompts", prefix, max_prompts, len(train)
        )
        train = train.head(max_prompts).reset_index(drop=True)
    logger.info("prompt tables: %d train, %d eval", len(train), len(evals))
    train = validate_prompt_table(train[list(PROMPT_COLUMNS)], f"{prefix}.train")
    evals = validate_prompt_table(evals[list(PROMPT_COLUMNS)], f"{prefix}.eval")
    return train, evals
