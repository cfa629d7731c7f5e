"""Saving and rebuilding the policy (its settings + quantized base) for single-node reruns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft.tuners.lora import LoraLayer

from qerl.errors import QerlConfigError
from qerl.quant.linear import QuantLinear
from qerl.train.policy import SPEC_FILE, load_policy, save_policy

IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])


def _logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _lora_layout(model) -> dict[str, type]:
    return {n: type(m) for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def test_save_and_load_nvfp4_policy_bit_identical(make_policy, helpers, tmp_path: Path) -> None:
    policy = make_policy("nvfp4")
    out = save_policy(policy, tmp_path / "policy")
    assert (out / SPEC_FILE).is_file() and (out / "base" / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["policy"]
    spec = json.loads((out / SPEC_FILE).read_text())
    assert spec["quant"]["format"] == "nvfp4" and (spec["lora"]["r"], spec["lora"]["alpha"]) == (4, 8)
    loaded = load_policy(out)
    assert loaded.identity() == policy.identity()
    assert (loaded.device, loaded.dtype) == (policy.device, policy.dtype)
    assert _lora_layout(loaded.model) == _lora_layout(policy.model)
    assert sum(isinstance(m, QuantLinear) for m in loaded.model.modules()) == 14
    a = {k: v for k, v in policy.model.state_dict().items() if "lora_" not in k}
    b = {k: v for k, v in loaded.model.state_dict().items() if "lora_" not in k}
    assert a.keys() == b.keys() and all(helpers.bit_equal(a[k], b[k]) for k in a)
    assert torch.equal(_logits(loaded.model), _logits(policy.model))


def test_save_policy_leaves_the_live_policy_intact(make_policy, helpers, tmp_path: Path) -> None:
    policy = make_policy("nvfp4", lora_seed=5)
    layout, state, logits = _lora_layout(policy.model), helpers.snapshot(policy.model), _logits(policy.model)
    with policy.model.disable_adapter():
        base_logits = _logits(policy.model)
    assert not torch.allclose(logits, base_logits)
    save_policy(policy, tmp_path / "p")
    save_policy(policy, tmp_path / "p")
    assert _lora_layout(policy.model) == layout
    after = helpers.snapshot(policy.model)
    assert all(helpers.bit_equal(after[k], state[k]) for k in state)
    assert torch.equal(_logits(policy.model), logits)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p"]
    torch.testing.assert_close(_logits(load_policy(tmp_path / "p").model), base_logits, atol=0, rtol=0)


def test_save_and_load_unquantized_policy_rebuilds_from_its_settings(make_policy, tiny_model_dir: Path,
                                                                     tmp_path: Path) -> None:
    policy = make_policy("none")
    out = save_policy(policy, tmp_path / "policy")
    assert sorted(p.name for p in out.iterdir()) == [SPEC_FILE]
    assert json.loads((out / SPEC_FILE).read_text())["model"]["path"] == str(tiny_model_dir)
    loaded = load_policy(out)
    assert loaded.identity() == policy.identity() and loaded.format == "none"
    assert not any(isinstance(m, QuantLinear) for m in loaded.model.modules())
    torch.testing.assert_close(_logits(loaded.model), _logits(policy.model), atol=0, rtol=0)


def test_load_policy_missing_dir(tmp_path: Path) -> None:
    with pytest.raises(QerlConfigError) as info:
        load_policy(tmp_path / "nothing")
    assert info.value.field == "policy" and "kedro run --pipelines=qerl_train" in info.value.fix


def test_lora_initialisation_is_seeded(make_policy) -> None:
    from qerl.params import LoraParams, ModelParams, QuantParams
    from qerl.train.policy import build_policy

    def adapter(seed: int):
        torch.manual_seed(seed + 100)  # the global RNG must not matter
        p, _ = build_policy(ModelParams(path=str(make_policy("none").model_settings.path), device="cpu"),
                            QuantParams(format="none"), LoraParams(r=4, alpha=8), seed=seed)
        return p.adapter_state_dict()

    a, b, c = adapter(0), adapter(0), adapter(1)
    assert all(torch.equal(a[k], b[k]) for k in a) and not all(torch.equal(a[k], c[k]) for k in a)
