"""Prompt-source specs: one pydantic model per source kind, and :func:`parse_sources`.

``data.sources`` is a list of mappings, each with a ``kind`` (default ``reasoning_gym``):

* ``kind: reasoning_gym`` -- ``name`` (a reasoning-gym dataset), ``size`` (default 100),
  ``seed`` (default 0), ``config`` (the generator's own options, checked against its config
  class).
* ``kind: file`` -- ``path`` to ``.jsonl`` / ``.json`` / ``.parquet`` / ``.csv`` (or ``format``),
  ``question_column`` / ``answer_column`` (default ``question`` / ``answer``), optional
  ``id_column`` and ``task``; ``answer_format``: ``auto`` | ``gsm8k`` | ``raw`` (GSM8K solutions
  ``"... #### 1,234"`` give the text after ``####``).
* ``kind: hf`` -- either ``path`` (a ``save_to_disk`` directory, a directory of data files or one
  data file) or ``name`` (a dataset already in the local HF cache; never downloaded), ``subset``,
  ``split`` (default ``train``), ``data_files``, ``cache_dir``, plus the column options of files.

Every kind also takes ``id_prefix`` (ids are ``<id_prefix>:<row>``) and ``use``: ``both``
(default; split into train and eval), ``train`` or ``eval``.

:data:`SourceSpec` is the discriminated union of the three models; it works as a pydantic field
type (``sources: list[SourceSpec]``). The models check everything that needs no I/O (types,
unknown keys, reasoning-gym task names and options, file suffixes); :func:`parse_sources` adds
the file-system checks (files exist) and turns every problem into a
:class:`~qerl.errors.QerlConfigError` naming ``data.sources[i].<field>`` and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from qerl.data.schema import SOURCE_FILE, SOURCE_HF, SOURCE_REASONING_GYM
from qerl.data.spec_checks import SpecProblem, check_reasoning_gym, close_names
from qerl.errors import QerlConfigError

__all__ = [
    "ANSWER_FORMATS",
    "FILE_FORMATS",
    "USES",
    "FileSource",
    "HFSource",
    "ReasoningGymSource",
    "SourceModel",
    "SourceSpec",
    "SpecProblem",
    "check_source_paths",
    "close_names",
    "parse_source",
    "parse_sources",
    "source_error",
]

#: File suffix -> format of a ``kind: file`` source.
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

Int = Annotated[int, Field(strict=True)]  # no bools, no "3", no 3.0
Text = Annotated[str, Field(min_length=1)]


class _Spec(BaseModel):
    """Options every source kind takes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id_prefix: str | None = None
    use: Literal["both", "train", "eval"] = "both"


class ReasoningGymSource(_Spec):
    """A reasoning-gym procedural generator (``kind: reasoning_gym``)."""

    kind: Literal["reasoning_gym"] = SOURCE_REASONING_GYM
    name: str
    size: Annotated[int, Field(strict=True, ge=1)] = 100
    seed: Int = 0
    config: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _known_task_and_options(self) -> ReasoningGymSource:
        check_reasoning_gym(self.name, self.size, self.seed, self.config)
        return self


class _Columns(_Spec):
    """Column options shared by file and Hugging Face sources."""

    question_column: Text = "question"
    answer_column: Text = "answer"
    id_column: str | None = None
    task: str | None = None
    answer_format: Literal["auto", "gsm8k", "raw"] = "auto"


class FileSource(_Columns):
    """A local JSONL / JSON / Parquet / CSV file (``kind: file``)."""

    kind: Literal["file"] = SOURCE_FILE
    path: Text
    format: str | None = None

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        if value is None:
            return None
        fmt = value.lower().lstrip(".")
        if fmt not in set(FILE_FORMATS.values()):
            raise SpecProblem(
                "",
                f"unsupported format {value!r}",
                f"use one of {sorted(set(FILE_FORMATS.values()))}",
            )
        return fmt

    @model_validator(mode="after")
    def _format_known(self) -> FileSource:
        if self.format is None and Path(self.path).suffix.lower() not in FILE_FORMATS:
            raise SpecProblem(
                "path",
                f"cannot tell the format of {self.path!r} from its suffix "
                f"{Path(self.path).suffix.lower()!r}",
                f"use a file ending in {sorted(FILE_FORMATS)} or set format",
            )
        return self

    @property
    def file_format(self) -> str:
        """The file's format: ``format`` or the one its suffix implies."""
        return self.format or FILE_FORMATS[Path(self.path).suffix.lower()]


class HFSource(_Columns):
    """A Hugging Face ``datasets`` dataset from a local path or the local cache (``kind: hf``)."""

    kind: Literal["hf"] = SOURCE_HF
    path: str | None = None
    name: str | None = None
    subset: str | None = None
    split: Text = "train"
    data_files: str | list[str] | None = None
    cache_dir: str | None = None

    @model_validator(mode="after")
    def _path_or_name(self) -> HFSource:
        if (self.path is None) == (self.name is None):
            raise SpecProblem(
                "",
                "give exactly one of `path` and `name`",
                "set path to a local dataset directory or file, or name to a dataset in the "
                "local Hugging Face cache",
            )
        return self


_MODELS: dict[str, type[_Spec]] = {
    SOURCE_REASONING_GYM: ReasoningGymSource,
    SOURCE_FILE: FileSource,
    SOURCE_HF: HFSource,
}


def _source_kind(value: Any) -> str | None:
    """The union tag of a raw source (``kind``, default ``reasoning_gym``) or of a model."""
    if isinstance(value, Mapping):
        kind = value.get("kind", SOURCE_REASONING_GYM)
        return kind if isinstance(kind, str) else None
    return getattr(value, "kind", None)


#: Any source spec; usable as a pydantic field type (``sources: list[SourceSpec]``).
SourceSpec = Annotated[
    Union[  # noqa: UP007 - a discriminated union needs the Union form for its Tag annotations
        Annotated[ReasoningGymSource, Tag(SOURCE_REASONING_GYM)],
        Annotated[FileSource, Tag(SOURCE_FILE)],
        Annotated[HFSource, Tag(SOURCE_HF)],
    ],
    Discriminator(_source_kind),
]
_ADAPTER: TypeAdapter[Any] = TypeAdapter(SourceSpec)
#: The same three models as a plain union, for type hints.
SourceModel = ReasoningGymSource | FileSource | HFSource


# --------------------------------------------------------------------------------- errors

#: Fix advice for type errors of particular fields.
_FIXES: dict[str, str] = {
    "config": "give the generator options as key: value pairs",
    "question_column": "name the column holding the questions",
    "answer_column": "name the column holding the gold answers",
    "split": "name a split, e.g. train or test",
    "path": "give the path as text",
    "data_files": "give a file name, a glob, or a list of them",
}


def _join(prefix: str, sub: str) -> str:
    return f"{prefix}.{sub}" if sub else prefix


def source_error(err: Mapping[str, Any], raw: Any, field: str) -> QerlConfigError:
    """One pydantic error of a source (an item of ``ValidationError.errors()``) as a
    :class:`QerlConfigError` under ``field`` (e.g. ``data.sources[2]``).

    ``err["loc"]`` must be relative to the source: a settings model that validates
    ``sources: list[SourceSpec]`` passes ``{**err, "loc": err["loc"][k:]}`` with ``k`` the
    position just after the list index. ``raw`` is the source as given.
    """
    loc = [str(x) for x in err["loc"]]
    kind = loc.pop(0) if loc and loc[0] in _MODELS else None
    etype, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    cause = ctx.get("error")
    if isinstance(cause, SpecProblem):
        return QerlConfigError(
            _join(field, ".".join([*loc, cause.sub]).strip(".")), cause.problem, cause.fix
        )
    if etype == "union_tag_invalid":
        return QerlConfigError(
            f"{field}.kind",
            f"unknown source kind {ctx.get('tag')!r}",
            f"use one of {sorted(_MODELS)}",
        )
    if kind is None:
        return QerlConfigError(
            field,
            f"expected a mapping with a string `kind`, got {raw!r}"[:200],
            f"give each source as key: value pairs with a kind in {sorted(_MODELS)}",
        )
    key = loc[0] if loc else ""
    fld = _join(field, key)
    allowed = sorted(_MODELS[kind].model_fields)
    if etype == "extra_forbidden":
        return QerlConfigError(
            fld,
            f"not an option of a {kind} source{close_names(key, allowed)}",
            f"use only {allowed}",
        )
    if etype == "missing":
        return QerlConfigError(fld, "is required", f"set {key} for this {kind} source")
    if etype.startswith("int_"):
        return QerlConfigError(fld, f"expected an integer, got {value!r}", "give a whole number")
    if etype == "greater_than_equal":
        return QerlConfigError(
            fld, f"must be >= {ctx['ge']}, got {value!r}", f"use {ctx['ge']} or more"
        )
    if etype == "string_too_short":
        return QerlConfigError(fld, "is empty", _FIXES.get(key, f"set {key}"))
    if etype == "literal_error":
        return QerlConfigError(fld, f"unknown value {value!r}", f"use one of {ctx.get('expected')}")
    if etype == "string_type":
        return QerlConfigError(
            fld, f"expected a string, got {value!r}", _FIXES.get(key, "quote the value")
        )
    if etype == "dict_type":
        return QerlConfigError(
            fld,
            f"expected a mapping, got {type(value).__name__}",
            _FIXES.get(key, "use key: value pairs"),
        )
    return QerlConfigError(
        fld,
        f"{err['msg']} (got {value!r})",
        _FIXES.get(key, f"see qerl.data.specs for the options of a {kind} source"),
    )


# --------------------------------------------------------------------------------- parsing


def check_source_paths(spec: SourceModel, field: str = "data.sources[0]") -> None:
    """The file-system checks of a source (the models do no I/O): its file / directory exists.

    Relative paths are resolved from the working directory (usually the project root).
    """
    if isinstance(spec, FileSource):
        path = Path(spec.path).expanduser()
        if not path.is_file():
            what = "is a directory, not a file" if path.is_dir() else "does not exist"
            raise QerlConfigError(
                f"{field}.path",
                f"{str(path)!r} {what}",
                "point it at an existing .jsonl/.json/.parquet/.csv file (relative paths are "
                "resolved from the working directory, usually the project root)",
            )
    elif isinstance(spec, HFSource) and spec.path is not None:
        if not Path(spec.path).expanduser().exists():
            raise QerlConfigError(
                f"{field}.path",
                f"{spec.path!r} does not exist",
                "point it at a save_to_disk directory, a directory of data files or a data file",
            )


def parse_source(
    raw: Any, field_name: str = "data.sources[0]", *, check_paths: bool = True
) -> SourceModel:
    """Validate one source (a mapping or a spec model) and return its spec model.

    Args:
        raw: the mapping from parameters (``kind`` defaults to ``reasoning_gym``), or a spec.
        field_name: parameter path of this source, used in error messages.
        check_paths: also check that the source's file / directory exists.

    Raises:
        QerlConfigError: unknown kind or key, missing key, wrong type, unknown reasoning-gym task
            or option, bad format option, missing file -- naming ``<field_name>.<key>``.
    """
    try:
        spec: SourceModel = _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        raise source_error(exc.errors()[0], raw, field_name) from None
    if check_paths:
        check_source_paths(spec, field_name)
    return spec


def parse_sources(
    raw: Any, field_name: str = "data.sources", *, check_paths: bool = True
) -> list[SourceModel]:
    """Validate every source of ``data.sources`` (see :func:`parse_source`) before any loading.

    Returns:
        The spec models (:class:`ReasoningGymSource` / :class:`FileSource` / :class:`HFSource`).

    Raises:
        QerlConfigError: ``raw`` is not a non-empty list, or a source is bad (the first one found,
            named ``data.sources[i].<key>``).
    """
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
    return [
        parse_source(r, f"{field_name}[{i}]", check_paths=check_paths) for i, r in enumerate(raw)
    ]
