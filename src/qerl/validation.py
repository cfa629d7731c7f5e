"""Validation of whole parameter blocks: every top-level key the project knows, unknown keys refused
with the close names, and pydantic's errors turned into one line naming the field and the fix."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, RootModel, ValidationError

from qerl.errors import QerlConfigError
from qerl.params import DataParams, ReplayParams, StudyParams, TinyModelParams, TrainParams


class TaskPresets(RootModel[dict[str, dict[str, Any]]]):
    """``embedded_tasks``: the embedded task presets (checked by ``qerl.embedded.presets`` when used)."""


BLOCKS: dict[str, type[BaseModel]] = {
    "data": DataParams,
    "embedded_model": TinyModelParams,
    "embedded_tasks": TaskPresets,
    "qerl": TrainParams,
    "quant_study": StudyParams,
    "replay": ReplayParams,
}
"""Every top-level parameter key the project knows, and its model."""


def validate_block(name: str, raw: Any) -> BaseModel:
    """Validate one top-level block; raise a one-line ``QerlConfigError`` naming the field."""
    if name not in BLOCKS:
        close = difflib.get_close_matches(name, BLOCKS, n=2)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise QerlConfigError(name, "is not a parameter block of this project",
                              f"{hint}the blocks are {', '.join(BLOCKS)}")
    model = BLOCKS[name]
    if isinstance(raw, model):
        return raw
    try:
        return model.model_validate(raw if raw is not None else {})
    except ValidationError as err:
        first = err.errors()[0]
        loc = first.get("loc", ())
        if name == "data" and len(loc) >= 2 and loc[0] == "sources" and isinstance(loc[1], int):
            from qerl.data.specs import source_error

            i = loc[1]
            sub = {**first, "loc": loc[2:]}
            raise source_error(sub, (raw or {}).get("sources", [])[i], f"data.sources[{i}]") from None
        raise config_error(name, err) from None


def train_params(raw: Any) -> TrainParams:
    """The ``qerl`` block as :class:`TrainParams` (a node that needs the whole block takes it as a
    mapping, whose sub-blocks Kedro has already validated, and calls this)."""
    return validate_block("qerl", raw)  # type: ignore[return-value]


def validate_all(params: dict[str, Any]) -> dict[str, BaseModel]:
    """Validate every top-level block of a parameters mapping (unknown keys refused)."""
    return {name: validate_block(name, raw) for name, raw in params.items()}


def config_error(prefix: str, err: ValidationError) -> QerlConfigError:
    """The first error of a pydantic ``ValidationError`` as one ``QerlConfigError`` line."""
    e = err.errors()[0]
    loc = ".".join(str(p) for p in (prefix, *e.get("loc", ())) if p != "__root__")
    kind = e.get("type", "")
    if kind == "extra_forbidden":
        parent, _, key = loc.rpartition(".")
        known = _known_fields(prefix, e.get("loc", ())[:-1])
        close = difflib.get_close_matches(key, known, n=2)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        return QerlConfigError(loc, "is not a known setting",
                               f"{hint}{parent or prefix} accepts {', '.join(known)}")
    got = e.get("input")
    msg = e.get("msg", "invalid value").removeprefix("Value error, ")
    if msg.startswith("@"):  # "@<field relative to loc>: <problem>; fix: <fix>" from a model validator
        field, _, rest = msg[1:].partition(": ")
        problem, _, fix = rest.partition("; fix: ")
        return QerlConfigError(f"{loc}.{field}", problem, fix or f"change {loc}.{field}")
    problem = msg if kind.startswith("value_error") or isinstance(got, dict) else f"{msg}, got {got!r}"
    return QerlConfigError(loc, problem, f"change {loc} in conf/ or --params "
                           f"(documented in conf/base/parameters_*.yml)")


def _known_fields(prefix: str, loc: tuple[Any, ...]) -> list[str]:
    model: Any = BLOCKS.get(prefix)
    for part in loc:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return sorted(model.model_fields) if model is not None else []


