"""The task family: every preset resolves to valid parameters, its data_prep block and qerl
overrides validate, and the embedded pipeline refuses held-out prompts of another task."""

from __future__ import annotations

import json

import pytest
import yaml

from qerl.data.sources import build_prompt_tables
from qerl.embedded.presets import data_params, deep_merge, qerl_overrides, resolve_params, task_of
from qerl.embedded.task import EmbeddedTask
from qerl.errors import QerlConfigError
from qerl.modeling.tiny import TinyModelSpec
from qerl.params import DataParams, TinyModelParams, TrainParams
from qerl.pipelines.embedded_model.nodes import build_sft_set

from .conftest import ROOT


def test_family_is_documented_and_diverse(presets):
    assert len(presets) >= 6
    names = {resolve_params(TinyModelParams.model_validate({"task": {"preset": n}}), presets).task.name for n in presets}
    assert "chain_sum" in names and len(names - {"chain_sum"}) >= 3
    doc = (ROOT / "docs" / "embedded-tasks.md").read_text()
    assert all(f"`{n}`" in doc for n in presets)


@pytest.mark.parametrize("name", ["chain_sum_2x2", "chain_sum_3x2", "leg_counting", "spell_backward"])
def test_preset_data_and_qerl_blocks_validate(presets, name):
    data = DataParams.model_validate(data_params(presets, name))
    train, evals = build_prompt_tables([{**data.sources[0].model_dump(), "size": 60}], data.template, data.system_prompt, eval_size=10)
    task = task_of(resolve_params(TinyModelParams.model_validate({"task": {"preset": name}}), presets))
    gen = json.loads(evals["metadata"].iloc[0])["reasoning_gym"]
    assert (gen["name"], gen["config"]) == (task.name, dict(task.config))
    assert evals["prompt"].iloc[0] == task.template.replace("{question}", evals["question"].iloc[0])
    base = yaml.safe_load((ROOT / "conf" / "base" / "parameters_qerl_train.yml").read_text())["qerl"]
    TrainParams.model_validate(deep_merge(base, qerl_overrides(presets, name)))
    p = resolve_params(TinyModelParams.model_validate({"task": {"preset": name}}), presets)
    TinyModelSpec(**p.spec).validate()


def test_default_preset_is_the_original_default(presets):
    p = resolve_params(TinyModelParams.model_validate({"task": {"preset": "chain_sum_2x2"}}), presets)
    assert p == TinyModelParams.model_validate({"task": {"preset": "chain_sum_2x2"}})  # nothing but the defaults
    assert data_params(presets, "chain_sum_2x2")["sources"][0] == yaml.safe_load(
        (ROOT / "conf" / "base" / "parameters_data_prep.yml").read_text())["data"]["sources"][0]


def test_held_out_prompts_of_another_task_are_refused(presets):
    other = build_prompt_tables([{"name": "chain_sum", "size": 30, "config": {"min_terms": 3, "max_terms": 3}}],
                                "{question}\n", "", eval_size=5)[1]
    with pytest.raises(QerlConfigError, match="data.sources"):
        build_sft_set(other, TinyModelParams.model_validate({"task": {"preset": "chain_sum_2x2"}}), presets)


def test_the_preset_sets_data_and_qerl_defaults_under_the_users_values(presets):
    from qerl.embedded.presets import apply_preset

    data = yaml.safe_load((ROOT / "conf" / "base" / "parameters_data_prep.yml").read_text())["data"]
    base = {"data": data, "qerl": {"rl": {"lr": 1e-3}, "rollout": {"max_new_tokens": 32}},
            "embedded_model": {"task": {"preset": "chain_sum_2x2"}}, "embedded_tasks": presets}
    assert apply_preset(base, base) == base  # the default preset changes nothing
    chosen = {**base, "embedded_model": {"task": {"preset": "leg_counting"}},
              "qerl": {"rl": {"lr": 5e-4}, "rollout": {"max_new_tokens": 32}}}
    out = apply_preset(chosen, base)
    assert out["data"]["sources"][0]["name"] == "leg_counting"
    assert out["qerl"]["rollout"]["max_new_tokens"] == 48  # the preset's, the user kept the base value
    assert out["qerl"]["rl"]["lr"] == 5e-4  # the user's value wins over base and preset
    mine = {**chosen, "data": {**base["data"], "eval_size": 50}}
    assert apply_preset(mine, base)["data"]["eval_size"] == 50
    with pytest.raises(QerlConfigError, match="embedded_model.task.preset"):
        apply_preset({**base, "embedded_model": {"task": {"preset": "leg_count"}}}, base)


def test_unknown_override_key_names_the_field(presets):
    from qerl.pipelines.embedded_model.nodes import train_embedded_model

    small = TinyModelParams.model_validate({"task": {"preset": "chain_sum_2x2"}, "sft_size": 20, "val_size": 4})
    sft_set = build_sft_set(EmbeddedTask().prompt_table(8, seed=17), small, presets)
    for block, key in (("sft", "stpes"), ("spec", "hidden"), ("band", "lo")):
        params = TinyModelParams.model_validate({"task": {"preset": "chain_sum_2x2"}, block: {key: 1}})
        with pytest.raises(QerlConfigError, match=f"embedded_model.{block}.{key}"):
            train_embedded_model(sft_set, params, presets)

