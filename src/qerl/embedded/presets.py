"""Task presets: one name picks the embedded task, its model size and warm-start budget, the RL
prompts and the RL settings that go with it.

A preset (``conf/base/parameters_embedded_tasks.yml``, block ``embedded_tasks``) is a mapping::

    chain_sum_3x2:
      description: three 2-digit terms, column arithmetic per step
      embedded_model: {task: {...}, spec: {...}, sft: {...}}  # partial embedded_model block
      data: {size: 2000, seed: 17, eval_size: 200}            # the RL prompts (data_prep)
      qerl: {rollout: {max_new_tokens: 48}, rl: {lr: 1e-3}}   # partial qerl block (qerl_train)

``embedded_model.task.preset`` selects one. Values the user sets in ``embedded_model`` win over
the preset's (:func:`resolve_params`); :func:`data_params` and :func:`qerl_overrides` give what
``data_prep`` and ``qerl_train`` must use for the same task.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from qerl.embedded.task import EmbeddedTask
from qerl.errors import QerlConfigError
from qerl.params import TinyModelParams

PRESET_FIELD = "embedded_model.task.preset"
PRESET_KEYS = ("description", "embedded_model", "data", "qerl")


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` laid over it, mapping by mapping (override wins on leaves)."""
    out = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def get_preset(presets: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """The preset ``name``, checked; :class:`QerlConfigError` naming the field otherwise."""
    if name not in presets:
        raise QerlConfigError(PRESET_FIELD, f"unknown task preset {name!r}", f"use one of {sorted(presets)} (embedded_tasks)")
    preset = presets[name]
    bad = sorted(set(preset) - set(PRESET_KEYS))
    if bad:
        raise QerlConfigError(f"embedded_tasks.{name}.{bad[0]}", "not a preset key", f"use only {list(PRESET_KEYS)}")
    return preset


def resolve_params(params: TinyModelParams, presets: Mapping[str, Any]) -> TinyModelParams:
    """The effective ``embedded_model`` parameters: the selected preset's block with every value the
    user set explicitly (``model_fields_set``, recursively) laid over it. No preset: unchanged."""
    name = params.task.preset
    if name is None:
        return params
    preset_block = dict(get_preset(presets, name).get("embedded_model") or {})
    merged = deep_merge(preset_block, params.model_dump(exclude_unset=True))
    try:
        return TinyModelParams.model_validate(merged)
    except ValueError as exc:
        raise QerlConfigError(f"embedded_tasks.{name}.embedded_model", str(exc), "fix the preset") from exc


def task_of(params: TinyModelParams) -> EmbeddedTask:
    """The :class:`EmbeddedTask` of (resolved) parameters."""
    t = params.task
    return EmbeddedTask(name=t.name, config=dict(t.config), template=t.template, trace=t.trace, trace_fraction=t.trace_fraction)


def data_params(presets: Mapping[str, Any], name: str, params: TinyModelParams | None = None) -> dict[str, Any]:
    """The ``data`` block (``qerl.params.DataParams``) whose prompts are preset ``name``'s task:
    one reasoning-gym source (size / seed from the preset's ``data``), the task's template, no
    system prompt, the preset's ``eval_size``."""
    base = TinyModelParams.model_validate({"task": {"preset": name}})
    task = task_of(resolve_params(params or base, presets))
    data = dict(get_preset(presets, name).get("data") or {})
    return {
        "sources": [task.source(int(data.get("size", 2000)), int(data.get("seed", 17)))],
        "template": task.template,
        "system_prompt": "",
        "eval_size": int(data.get("eval_size", 200)),
    }


def qerl_overrides(presets: Mapping[str, Any], name: str) -> dict[str, Any]:
    """Preset ``name``'s partial ``qerl`` block (lay it under the user's ``qerl`` parameters)."""
    return copy.deepcopy(dict(get_preset(presets, name).get("qerl") or {}))


def _changed(merged: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """The leaves of ``merged`` that ``base`` does not have or has with another value."""
    out: dict[str, Any] = {}
    for key, value in merged.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), Mapping):
            sub = _changed(value, base[key])
            if sub:
                out[key] = sub
        elif key not in base or base[key] != value:
            out[key] = copy.deepcopy(value)
    return out


def apply_preset(params: Mapping[str, Any], base: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters with the selected preset's ``data`` and ``qerl`` parts under the user's values.

    ``params``: the merged parameters of the run (base + env + ``--params``); ``base``: those of
    ``conf/base`` alone. What differs between the two is the user's and wins; the preset fills the
    rest of ``data`` and ``qerl``; everything else stays as it is. No preset selected: unchanged.
    """
    name = ((params.get("embedded_model") or {}).get("task") or {}).get("preset")
    presets = params.get("embedded_tasks") or {}
    if not name or not presets:
        return dict(params)
    embedded = TinyModelParams.model_validate(params.get("embedded_model") or {})
    overlay = {"data": data_params(presets, name, embedded), "qerl": qerl_overrides(presets, name)}
    return deep_merge(deep_merge(base, overlay), _changed(params, base))
