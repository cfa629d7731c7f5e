"""The settings model: defaults equal conf/base, every bad value refused with its field and a fix,
before any model is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

import qerl.train.policy as policy_mod
from qerl.errors import QerlConfigError
from qerl.params import TrainParams
from qerl.pipelines.qerl_train.nodes import setup_quantized_policy
from qerl.validation import BLOCKS, validate_all, validate_block

ROOT = Path(__file__).resolve().parents[2]


def _conf(env: str = "base") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in sorted((ROOT / "conf" / env).glob("parameters*.yml")):
        out.update(yaml.safe_load(f.read_text()) or {})
    return out


def _tuples_to_lists(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _tuples_to_lists(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_tuples_to_lists(v) for v in x]
    return x


@pytest.mark.parametrize("block", ["qerl", "data", "replay"])
def test_model_defaults_are_the_conf_base_values(block: str) -> None:
    """conf/base documents the defaults; the model holds them: they may never drift apart."""
    conf = _conf()[block]
    assert _tuples_to_lists(BLOCKS[block]().model_dump(mode="json")) == _tuples_to_lists(
        BLOCKS[block].model_validate(conf).model_dump(mode="json"))
    assert _tuples_to_lists(BLOCKS[block].model_validate(conf).model_dump(mode="json")) == _tuples_to_lists(
        BLOCKS[block]().model_dump(mode="json"))


@pytest.mark.parametrize("env", ["base", "gpu_paper"])
def test_every_shipped_configuration_validates(env: str) -> None:
    merged = _conf("base")
    for key, value in _conf(env).items():
        merged[key] = {**merged.get(key, {}), **value} if isinstance(value, dict) else value
    validated = validate_all(merged)
    assert set(validated) == set(merged) <= set(BLOCKS)


@pytest.mark.parametrize(
    "raw,field,needle",
    [
        ({"quant": {"format": "int3"}}, "qerl.quant.format", "'nvfp4' or 'mxfp4'"),
        ({"quant": {"fromat": "nvfp4"}}, "qerl.quant.fromat", "did you mean format"),
        ({"rl": {"stpes": 3}}, "qerl.rl.stpes", "did you mean steps"),
        ({"rl": {"steps": "abc"}}, "qerl.rl.steps", "valid integer"),
        ({"rl": {"lr": -1}}, "qerl.rl.lr", "greater than 0"),
        ({"surprise": 1}, "qerl.surprise", "not a known setting"),
        ({"rollout": {"group_size": 1}}, "qerl.rollout.group_size", "pg_entropy"),
        ({"rl": {"minibatches": 3}}, "qerl.rl.minibatches", "divisor of 128"),
        ({"rollout": {"temperature": 0}}, "qerl.rollout.temperature", "greater than 0"),
        ({"report": {"formats": ["nvfp4", "int2"]}}, "qerl.report.formats.1", "'nvfp4'"),
        ({"rl": {"loss_type": "ppo2"}}, "qerl.rl.loss_type", "'dapo'"),
        ({"noise": {"schedule": "zigzag"}}, "qerl.noise.schedule", "'exponential'"),
        ({"noise": {"stages": 1}}, "qerl.noise.stages", "greater than or equal to 2"),
        ({"noise": {"sigma_end": 0}}, "qerl.noise", "exponential"),
        ({"noise": {"controller": {"sigma_min": 0.1, "sigma_max": 0.01}}}, "qerl.noise.controller", "below sigma_min"),
        ({"rl": {"old_logprobs": "rollout"}}, "qerl.rl.rollout_is", "recompute"),
        ({"rewards": {"functions": [{"name": "exact_match"}, {"name": "no_such_reward"}]}},
         "qerl.rewards.functions[1].name", "unknown reward"),
        ({"rewards": {"functions": [{"name": "exact_match", "kwargs": {"nope": 1}}]}},
         "qerl.rewards.functions[0].kwargs.nope", "not an option"),
        ({"rl": {"run_name": "a/b"}}, "qerl.rl.run_name", "pattern"),
    ],
)
def test_bad_settings_are_refused_with_field_and_fix(raw: dict, field: str, needle: str) -> None:
    with pytest.raises(QerlConfigError) as info:
        validate_block("qerl", raw)
    assert info.value.field == field, str(info.value)
    assert needle in str(info.value) and "Fix:" in str(info.value)


def test_unknown_top_level_block_names_the_close_one() -> None:
    with pytest.raises(QerlConfigError, match="did you mean qerl"):
        validate_all({"qerll": {"rl": {"steps": 5}}})


def test_group_size_one_is_fine_without_group_advantages_and_params_are_frozen() -> None:
    p = TrainParams(rollout={"group_size": 1}, rl={"loss_type": "pg_entropy"})
    assert p.rollout.group_size == 1
    with pytest.raises(ValidationError):
        p.rl.lr = 1.0  # type: ignore[misc]
    assert TrainParams(lora={"preset": "paper"}).lora.r == 32
    assert p.with_updates(rl={"seed": 3}).rl.seed == 3 and p.rl.seed == 0


def test_setup_reaches_the_loader_only_with_valid_settings(monkeypatch, tiny_model_dir: Path) -> None:
    class Loaded(Exception):
        pass

    seen: dict[str, Any] = {}

    def fake_load(path, fmt, **kwargs):
        seen.update(path=path, fmt=fmt, **kwargs)
        raise Loaded

    monkeypatch.setattr(policy_mod, "load_policy_base", fake_load)
    p = TrainParams(model={"path": str(tiny_model_dir), "device": "cpu"}, quant={"format": "mxfp4"})
    with pytest.raises(Loaded):
        setup_quantized_policy(p.model, p.quant, p.lora, p.rl)
    assert seen["path"] == str(tiny_model_dir) and seen["fmt"] == "mxfp4"
    assert seen["skip_modules"] == ("lm_head",) and seen["on_indivisible"] == "skip"


def test_setup_builds_the_policy_and_report(tiny_model_dir: Path) -> None:
    p = TrainParams(model={"path": str(tiny_model_dir), "device": "cpu"}, lora={"r": 4, "alpha": 8})
    policy, report = setup_quantized_policy(p.model, p.quant, p.lora, p.rl)
    assert policy.format == "nvfp4" and (policy.lora.r, policy.lora.alpha) == (4, 8)
    assert len(report) == 2 * 7 + 1 and "name" in report.columns
    assert len(policy.lora_parameters()) == 2 * 7 * 2
