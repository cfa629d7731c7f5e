"""The warm start's accuracy band: a tiny budget ends with a warning naming the accuracy, the band
and the fix; the error mode raises QerlConfigError before the pipeline writes any model."""

from __future__ import annotations

import pytest

from qerl.embedded.presets import resolve_params
from qerl.embedded.sft import SFTConfig
from qerl.embedded.task import EmbeddedTask, distinct_rows, split_rows
from qerl.embedded.warm_start import Band, WarmStartBandWarning, greedy_accuracy, warm_start
from qerl.errors import QerlConfigError
from qerl.params import TinyModelParams

TINY_BUDGET = {"max_steps": 4, "min_steps": 2, "check_every": 2, "batch_size": 8, "num_threads": 1}


@pytest.fixture(scope="module")
def data():
    task = EmbeddedTask()
    rows = distinct_rows(task, 120, seed=3)
    parts = split_rows(rows, {"sft": 100, "val": 20})
    prompts, comps = task.sft_pairs(parts["sft"], seed=0)
    return prompts, comps, parts["val"]


def test_tiny_budget_warns_with_accuracy_band_and_fix(data, small_spec):
    prompts, comps, val = data
    with pytest.warns(WarmStartBandWarning) as rec:
        ws = warm_start(prompts, comps, val, small_spec, SFTConfig(**TINY_BUDGET), Band(), max_new_tokens=8)
    msg = str(rec[0].message)
    assert ws.steps == 4 and [s for s, _ in ws.val_curve] == [2, 4] and not ws.in_band
    assert ws.val_accuracy == ws.val_curve[-1][1] < 0.15
    assert f"{ws.val_accuracy:.1%}" in msg and "15%-70%" in msg and "max_steps=4" in msg
    assert "embedded_model.spec" in msg and "hidden_size 64 -> 128" in msg and "easier task" in msg
    # the curve is the verifier's judgement of the returned model
    assert greedy_accuracy(ws.model, ws.tokenizer, val, 8)[0] == ws.val_accuracy


def test_error_mode_raises_config_error(data, small_spec):
    prompts, comps, val = data
    with pytest.raises(QerlConfigError, match="embedded_model.band") as exc:
        warm_start(prompts, comps, val, small_spec, SFTConfig(**TINY_BUDGET), Band(on_miss="error"), max_new_tokens=8)
    assert "15%-70%" in exc.value.problem and "on_miss: warn" in exc.value.fix


def test_no_early_stop_measures_once_at_the_end(data, small_spec):
    prompts, comps, val = data
    cfg = SFTConfig(steps=3, target_accuracy=None, batch_size=8, num_threads=1)
    with pytest.warns(WarmStartBandWarning):
        ws = warm_start(prompts, comps, val, small_spec, cfg, Band(), max_new_tokens=8)
    assert ws.steps == 3 and [s for s, _ in ws.val_curve] == [3]


@pytest.mark.parametrize(
    ("sft", "band", "field"),
    [({"target_accuracy": 0.9}, {}, "embedded_model.sft.target_accuracy"),
     ({}, {"low": 0.8, "high": 0.2}, "embedded_model.band"),
     ({}, {"on_miss": "ignore"}, "embedded_model.band.on_miss")],
)
def test_bad_band_refused_before_training(data, small_spec, sft, band, field):
    prompts, comps, val = data
    with pytest.raises(QerlConfigError, match=field):
        warm_start(prompts, comps, val, small_spec, SFTConfig(**sft), Band(**band))


def test_pipeline_error_mode_writes_no_model(tmp_path, presets):
    """The Kedro nodes with the real model dataset: the band error stops the run before saving."""
    from kedro.io import DataCatalog, MemoryDataset
    from kedro.runner import SequentialRunner

    from qerl.datasets.hf_model import HFModelDataset
    from qerl.pipelines.embedded_model import create_pipeline

    params = TinyModelParams.model_validate({
        "task": {"preset": "chain_sum_2x2"}, "band": {"on_miss": "error"}, "sft_size": 100, "val_size": 20,
        "spec": {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 128},
        "sft": TINY_BUDGET, "eval_max_new_tokens": 8,
    })
    eval_prompts = EmbeddedTask().prompt_table(10, seed=17)
    model_dir = tmp_path / "embedded_model"
    catalog = DataCatalog({
        "eval_prompts": MemoryDataset(eval_prompts), "params:embedded_model": MemoryDataset(params),
        "params:embedded_tasks": MemoryDataset(presets), "embedded_model": HFModelDataset(path=str(model_dir)),
    })
    pipe = create_pipeline().only_nodes("build_sft_set", "train_embedded_model")
    with pytest.raises(QerlConfigError, match="embedded_model.band"):
        SequentialRunner().run(pipe, catalog)
    assert not model_dir.exists() and not any(tmp_path.iterdir())
    # the same run in warn mode writes the model
    catalog["params:embedded_model"] = MemoryDataset(params.model_copy(update={"band": {"on_miss": "warn"}}))
    with pytest.warns(WarmStartBandWarning):
        SequentialRunner().run(pipe, catalog)
    assert (model_dir / "config.json").exists()


def test_presets_resolve_user_values_win(presets):
    p = resolve_params(TinyModelParams.model_validate({"task": {"preset": "chain_sum_3x2", "trace_fraction": 0.5},
                                                        "sft": {"lr": 5e-4}}), presets)
    assert p.task.config == {"min_terms": 3, "max_terms": 3, "min_digits": 2, "max_digits": 2}
    assert p.task.trace == "column" and p.task.trace_fraction == 0.5
    assert p.sft["lr"] == 5e-4 and p.sft["max_steps"] == presets["chain_sum_3x2"]["embedded_model"]["sft"]["max_steps"]
    with pytest.raises(QerlConfigError, match="embedded_model.task.preset"):
        resolve_params(TinyModelParams.model_validate({"task": {"preset": "chain_sum_9x9"}}), presets)
