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
from pathlib import Path
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


def write_env(presets: Mapping[str, Any], name: str, env_dir: str | Path, qerl_base: Mapping[str, Any] | None = None) -> Path:
    """Write a Kedro env folder that runs preset ``name`` end to end with today's pipelines:
    ``parameters_data_prep.yml`` (:func:`data_params`), ``parameters_embedded_model.yml`` (the
    preset) and ``parameters_qerl_train.yml`` (:func:`qerl_overrides` over ``qerl_base``, with its
    own ``rl.run_name``). ``kedro run --pipeline=embedded_model -e ENV`` then
    ``kedro run --pipeline=qerl_train -e ENV``. Returns the folder."""
    import yaml

    get_preset(presets, name)
    out = Path(env_dir)
    out.mkdir(parents=True, exist_ok=True)
    qerl = deep_merge(deep_merge(dict(qerl_base or {}), qerl_overrides(presets, name)), {"rl": {"run_name": f"embedded_{name}"}})
    files = {
        "parameters_data_prep.yml": {"data": data_params(presets, name)},
        "parameters_embedded_model.yml": {"embedded_model": {"task": {"preset": name}}},
        "parameters_qerl_train.yml": {"qerl": qerl},
    }
    for fname, block in files.items():
        (out / fname).write_text(yaml.safe_dump(block, sort_keys=False))
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m qerl.embedded.presets NAME ENV_DIR [PRESETS_YAML]``: write :func:`write_env`."""
    import sys

    import yaml

    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        raise SystemExit("usage: python -m qerl.embedded.presets NAME ENV_DIR [conf/base/parameters_embedded_tasks.yml]")
    path = Path(args[2] if len(args) == 3 else "conf/base/parameters_embedded_tasks.yml")
    presets = yaml.safe_load(path.read_text())["embedded_tasks"]
    print(write_env(presets, args[0], args[1]))


if __name__ == "__main__":
    main()
