"""Hugging Face ``datasets`` sources (``kind: hf``): a local path or the local cache, never the hub."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from qerl.data.rows import check_not_empty, records_to_table
from qerl.data.schema import SOURCE_HF
from qerl.data.specs import FILE_FORMATS, HFSource, parse_source
from qerl.data.templates import PromptTemplate
from qerl.errors import QerlConfigError

#: Files that mark a ``save_to_disk`` directory (DatasetDict / Dataset).
_SAVED_MARKERS = ("dataset_dict.json", "state.json")
_HF_BUILDERS = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}


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


def _load_from_path(spec: HFSource, fld: str) -> Any:
    """The selected split of a ``save_to_disk`` directory, a data directory or a data file."""
    import datasets

    path = Path(str(spec.path)).expanduser()
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
                obj = datasets.load_dataset(
                    _HF_BUILDERS[fmt], data_files=str(path), cache_dir=spec.cache_dir
                )
            else:
                obj = datasets.load_dataset(
                    str(path),
                    name=spec.subset,
                    data_files=spec.data_files,
                    cache_dir=spec.cache_dir,
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


def _load_cached(spec: HFSource, fld: str) -> Any:
    """The selected split of a dataset in the local Hugging Face cache (never downloaded)."""
    import datasets

    try:
        with hf_offline():
            return datasets.load_dataset(
                spec.name, name=spec.subset, split=spec.split, cache_dir=spec.cache_dir
            )
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise QerlConfigError(
                f"{fld}.split", f"{exc}", "set split to one of the dataset's splits"
            ) from exc
        raise _not_cached(spec, fld, exc) from exc
    except Exception as exc:
        raise _not_cached(spec, fld, exc) from exc


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
        if parsed.path is not None:
            obj = _load_from_path(parsed, field_name)
        else:
            obj = _load_cached(parsed, field_name)
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    where = parsed.path if parsed.path is not None else parsed.name
    what = f"split {parsed.split!r} of {where!r}"
    raw = obj.to_pandas()
    check_not_empty(raw, f"{field_name}.{'path' if parsed.path is not None else 'name'}", what)
    origin = {
        "kind": SOURCE_HF,
        "path": parsed.path,
        "name": parsed.name,
        "subset": parsed.subset,
        "split": parsed.split,
    }
    return records_to_table(raw, parsed, field_name, origin, template, what)
