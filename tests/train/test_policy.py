"""Saving and rebuilding the policy (spec + quantized base) for single-node reruns."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from peft.tuners.lora import LoraLayer

from qerl.errors import QerlConfigError
from qerl.quant.linear import QuantLinear
from qerl.train.policy import PolicySpec, load_policy, save_policy

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


def _logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _lora_layout(model) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def test_save_and_load_nvfp4_policy_bit_identical(make_policy, helpers, tmp_path: Path) -> None:
    policy = make_policy("nvfp4")
    out = save_policy(policy, tmp_path / "policy")
    assert out == tmp_path / "policy"
    assert (out / "spec.json").is_file() and (out / "base" / "model.safetensors").is_file()
    assert (out / "base" / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]  # no .partial-* left
    spec = json.loads((out / "spec.json").read_text())
    assert spec["format"] == "nvfp4" and spec["lora"] == {"r": 4, "alpha": 8} and spec["skip_modules"] == ["lm_head"]

    loaded = load_policy(out)
    assert loaded.spec == policy.spec
    assert (loaded.device, loaded.dtype) == (policy.device, policy.dtype)
    assert loaded.eos_token_ids == policy.eos_token_ids and loaded.pad_token_id == policy.pad_token_id
    assert _lora_layout(loaded.model) == _lora_layout(policy.model)
    assert sum(isinstance(m, QuantLinear) for m in loaded.model.modules()) == 14

    a = {k: v for k, v in policy.model.state_dict().items() if "lora_" not in k}
    b = {k: v for k, v in loaded.model.state_dict().items() if "lora_" not in k}
    assert a.keys() == b.keys()
    assert any(k.endswith("weight_packed") for k in a) and any(k.endswith("weight_scale") for k in a)
    assert all(helpers.bit_equal(a[k], b[k]) for k in a)
    # both adapters are fresh (B = 0): the same function
    assert torch.equal(_logits(loaded.model), _logits(policy.model))
    # and the loaded policy trains like the original (LoRA parameters present and trainable)
    assert len(loaded.lora_parameters()) == len(policy.lora_parameters()) == 2 * 7 * 2


def test_save_policy_leaves_the_live_policy_intact(make_policy, helpers, tmp_path: Path) -> None:
    policy = make_policy("nvfp4", lora_seed=5)
    layout = _lora_layout(policy.model)
    state = helpers.snapshot(policy.model)
    logits = _logits(policy.model)
    with policy.model.disable_adapter():
        base_logits = _logits(policy.model)
    assert not torch.allclose(logits, base_logits)  # the adapter matters

    save_policy(policy, tmp_path / "p")
    save_policy(policy, tmp_path / "p")  # overwriting an existing save is fine too

    assert _lora_layout(policy.model) == layout
    assert hasattr(policy.model.get_base_model(), "peft_config")
    after = helpers.snapshot(policy.model)
    assert after.keys() == state.keys() and all(helpers.bit_equal(after[k], state[k]) for k in state)
    assert torch.equal(_logits(policy.model), logits)  # adapter still applied
    assert len(policy.lora_parameters()) == 2 * 7 * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]

    # the saved base is the base without the adapter
    loaded = load_policy(tmp_path / "p")
    torch.testing.assert_close(_logits(loaded.model), base_logits, atol=0, rtol=0)


def test_save_and_load_unquantized_policy_rebuilds_from_spec(make_policy, tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = make_policy("none")
    out = save_policy(policy, tmp_path / "policy")
    assert sorted(p.name for p in out.iterdir()) == ["spec.json"]
    assert json.loads((out / "spec.json").read_text())["model_path"] == str(tiny_model_dir)
    loaded = load_policy(out)
    assert loaded.spec == policy.spec and loaded.spec.format == "none"
    assert not any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    assert _lora_layout(loaded.model) == _lora_layout(policy.model)
    torch.testing.assert_close(_logits(loaded.model), _logits(policy.model), atol=0, rtol=0)


def test_load_policy_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(QerlConfigError) as info:
        load_policy(tmp_path / "nothing")
    assert info.value.field == "policy"
    assert "kedro run --pipeline=qerl_train" in info.value.fix


def test_policy_spec_is_a_frozen_value() -> None:
    spec = PolicySpec(model_path="x")
    assert (spec.format, spec.skip_modules) == ("nvfp4", ("lm_head",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.format = "none"  # type: ignore[misc]
