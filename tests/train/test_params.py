"""Typed training parameters and the up-front validation of ``setup_quantized_policy``:
every bad setting must fail with its field name before any model is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

import qerl.train.policy as policy_mod
from qerl.errors import QerlConfigError
from qerl.params import TrainParams
from qerl.pipelines.qerl_train import nodes
from qerl.pipelines.qerl_train.nodes import (
    run_fingerprint,
    setup_quantized_policy,
    validate_train_params,
)

REWARDS = {"functions": [{"name": "exact_match"}]}


def _params(**over: Any) -> TrainParams:
    raw: dict[str, Any] = {"rewards": REWARDS, "rl": {"steps": 4, "prompts_per_step": 2}, "rollout": {"group_size": 4}}
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return TrainParams.model_validate(raw)


def test_defaults_validate() -> None:
    p = _params()
    assert p.quant.format == "nvfp4" and p.rl.loss_type == "dapo" and p.rollout.group_size == 4
    validate_train_params(p, n_rounds=4)


@pytest.mark.parametrize(
    "over,needle",
    [
        ({"quant": {"format": "int3"}}, "quant.format"),
        ({"quant": {"fromat": "nvfp4"}}, "fromat"),
        ({"rl": {"stpes": 3}}, "stpes"),
        ({"surprise": 1}, "surprise"),
        ({"rewards": {"functions": [{"name": "format"}], "extra": 1}}, "extra"),
        ({"rollout": {"group_size": 1}}, "group_size"),
        ({"rl": {"minibatches": 3}}, "minibatches"),
        ({"rollout": {"temperature": 0}}, "temperature"),
        ({"report": {"formats": ["nvfp4", "int2"]}}, "report.formats"),
    ],
)
def test_train_params_refuses(over: dict, needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        _params(**over)
    assert needle in str(info.value)


def test_group_size_one_is_fine_without_group_advantages() -> None:
    p = _params(rollout={"group_size": 1}, rl={"loss_type": "pg_entropy"})
    assert p.rollout.group_size == 1
    assert _params(rl={"minibatches": 4}).rl.minibatches == 4  # 2 prompts * 4 samples = 8


def test_params_are_frozen() -> None:
    p = _params()
    with pytest.raises(ValidationError):
        p.rl.lr = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "over,n_rounds,field",
    [
        ({"rl": {"loss_type": "ppo2"}}, 4, "rl.loss_type"),
        ({"noise": {"schedule": "zigzag"}}, 4, "noise.schedule"),
        ({"noise": {"stages": 1}}, 4, "noise.stages"),
        ({"rewards": {"functions": [{"name": "exact_match"}, {"name": "no_such_reward"}]}}, 4,
         "qerl.rewards.functions[1].name"),
        ({"rewards": {"functions": [{"name": "exact_match", "kwargs": {"nope": 1}}]}}, 4,
         "qerl.rewards.functions[0].kwargs.nope"),
        ({}, 5, "qerl.rl.steps"),
    ],
)
def test_setup_validates_everything_before_loading(monkeypatch, over: dict, n_rounds: int, field: str) -> None:
    loads: list[Any] = []

    def no_load(*args: Any, **kwargs: Any):
        loads.append(args)
        raise AssertionError("the model was loaded before the settings were validated")

    monkeypatch.setattr(policy_mod, "load_policy_base", no_load)
    p = _params(**over)
    with pytest.raises(QerlConfigError) as info:
        validate_train_params(p, n_rounds)
    assert info.value.field == field
    with pytest.raises(QerlConfigError) as info:
        setup_quantized_policy(p, n_rounds=n_rounds)
    assert info.value.field == field
    assert loads == []


def test_setup_reaches_the_loader_with_valid_settings(monkeypatch, tiny_model_dir: Path) -> None:
    """Control for the test above: with good settings the (patched) loader is what stops it."""

    class Loaded(Exception):
        pass

    seen: dict[str, Any] = {}

    def fake_load(path, fmt, **kwargs):
        seen.update(path=path, fmt=fmt, **kwargs)
        raise Loaded

    monkeypatch.setattr(policy_mod, "load_policy_base", fake_load)
    p = _params(model={"path": str(tiny_model_dir), "device": "cpu"}, quant={"format": "mxfp4"})
    with pytest.raises(Loaded):
        setup_quantized_policy(p, n_rounds=4)
    assert seen["path"] == str(tiny_model_dir) and seen["fmt"] == "mxfp4"
    assert seen["skip_modules"] == ("lm_head",) and seen["on_indivisible"] == "skip"


def test_setup_builds_the_policy_and_report(tiny_model_dir: Path) -> None:
    p = _params(model={"path": str(tiny_model_dir), "device": "cpu"}, lora={"r": 4, "alpha": 8})
    policy, report = setup_quantized_policy(p, n_rounds=4)
    assert policy.spec.format == "nvfp4" and policy.spec == nodes.policy_spec(p)
    assert (policy.spec.lora["r"], policy.spec.lora["alpha"]) == (4, 8) and "preset" not in policy.spec.lora
    assert len(report) == 2 * 7 + 1 and "name" in report.columns  # 14 projections + lm_head
    assert len(policy.lora_parameters()) == 2 * 7 * 2


def test_run_fingerprint_ignores_bookkeeping_only() -> None:
    base = run_fingerprint(_params())
    assert run_fingerprint(_params(rl={"save_every": 3, "resume": "never", "max_bad_steps": 9})) == base
    assert run_fingerprint(_params(eval={"k": 2})) == base
    assert run_fingerprint(_params(rl={"lr": 2e-5})) != base
    assert run_fingerprint(_params(quant={"format": "mxfp4"})) != base
