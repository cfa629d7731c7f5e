"""LoRA on every base format: settings, target validation, one training step, adapter save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl.errors import QerlConfigError
from qerl.modeling.loader import load_policy_base
from qerl.modeling.lora import apply_lora, check_lora_targets, to_peft_config
from qerl.params import ALL_PROJECTIONS
from qerl.params import LoraParams as LoraSettings
from qerl.quant.report import quant_report
from qerl.validation import validate_block

torch.set_num_threads(1)

ALL_FORMATS = ["none", "nf4", "fp4", "nvfp4", "mxfp4"]


def _load(path: Path, fmt: str):  # -> model
    if fmt in ("nf4", "fp4"):
        pytest.importorskip("bitsandbytes")
    model, _, _ = load_policy_base(path, fmt, compute_dtype="float32")
    return model


def _batch(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(seed))


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def test_settings_presets_and_validation() -> None:
    default = LoraSettings()
    assert (default.r, default.alpha, default.dropout, default.bias) == (16, 32, 0.0, "none")
    assert default.target_modules == ALL_PROJECTIONS and len(ALL_PROJECTIONS) == 7
    paper = LoraSettings(preset="paper", r=4)
    assert (paper.r, paper.alpha, paper.target_modules) == (32, 64, ALL_PROJECTIONS)
    assert LoraSettings(target_modules=["q_proj"]).target_modules == ("q_proj",)
    cfg = to_peft_config(paper)
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules)) == (32, 64, set(ALL_PROJECTIONS))
    for kwargs, field in [
        ({"r": 0}, "qerl.lora.r"),
        ({"alpha": 0}, "qerl.lora.alpha"),
        ({"dropout": 1.0}, "qerl.lora.dropout"),
        ({"target_modules": []}, "qerl.lora.target_modules"),
        ({"bias": "some"}, "qerl.lora.bias"),
    ]:
        with pytest.raises(QerlConfigError) as info:
            validate_block("qerl", {"lora": kwargs})
        assert info.value.field == field


def test_missing_targets_are_named_before_wrapping(tiny_model_dir: Path) -> None:
    model = _load(tiny_model_dir, "nvfp4")
    with pytest.raises(QerlConfigError) as info:
        apply_lora(model, LoraSettings(target_modules=("q_proj", "c_attn", "wqkv")))
    err = info.value
    assert err.field == "lora.target_modules"
    assert "c_attn" in err.problem and "wqkv" in err.problem and "'q_proj'" not in err.problem
    assert "q_proj" in err.fix and "down_proj" in err.fix
    assert not hasattr(model, "peft_config")
    check_lora_targets(model, ("self_attn.q_proj", "lm_head"))  # dotted suffixes are fine


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_one_training_step_changes_only_lora(tiny_model_dir: Path, fmt: str) -> None:
    model = apply_lora(_load(tiny_model_dir, fmt), LoraSettings(r=4, alpha=8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B, 7 projections, 2 layers

    before = _snapshot(model)
    model.train()
    ids = _batch()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(grads) <= trainable
    assert any(".lora_B." in n and g.abs().sum() > 0 for n, g in grads.items())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt.step()

    after = model.state_dict()
    changed = {k for k in before if not _same(before[k], after[k])}
    assert changed, "the optimizer step changed nothing"
    assert all(".lora_" in k for k in changed), sorted(k for k in changed if ".lora_" not in k)
    assert any(".lora_B." in k for k in changed)

    rows = {r["name"]: r for r in quant_report(model)}  # LoRA wrappers resolve to base layers
    assert len(rows) == 15 and not any("lora" in n or "base_layer" in n for n in rows)
    expected_format = {"none": "fp32"}.get(fmt, fmt)
    assert rows["model.layers.1.mlp.up_proj"]["format"] == expected_format


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_eval_forward_leaves_training_gradients_intact(tiny_model_dir: Path, fmt: str) -> None:
    """An inference forward (evaluation, rollouts) must not change what training computes.

    Regression: bitsandbytes repacked Linear4bit weights for CPU inference on the first eval-mode
    no-grad forward (on CPUs with AVX512-BF16) and from then on ran a matmul without backward,
    so no gradient flowed through the frozen 4-bit layers and NF4/FP4 LoRA barely learned.
    """
    model = apply_lora(_load(tiny_model_dir, fmt), LoraSettings(r=4, alpha=8))
    # the switch itself, so that this fails on CPUs without AVX512-BF16 too
    assert not any(getattr(m, "support_avx512bf16_for_cpu", False) for m in model.modules())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = _batch(3)

    def grads() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.train()
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        torch.log_softmax(logits, -1)[..., 5].mean().backward()
        model.eval()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                 if p.requires_grad}

    logits0, g0 = grads()
    with torch.no_grad():
        model(input_ids=_batch(4))  # e.g. evaluate_before or a rollout
        model(input_ids=_batch(5)[:1, :1])  # a single-row decode step
    logits1, g1 = grads()
    assert torch.allclose(logits0, logits1, atol=1e-5, rtol=0)
    first_q = [n for n in g0 if "layers.0." in n and "q_proj.lora_B" in n]
    assert first_q and float(g0[first_q[0]].norm()) > 0, "no gradient reaches the first layer"
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-6, rtol=1e-4), n
    packed = [n for n, m in model.named_modules()
              if getattr(getattr(getattr(m, "weight", None), "quant_state", None),
                         "packing_format_for_cpu", False)]
    assert not packed


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_adapter_save_and_load(tiny_model_dir: Path, tmp_path: Path, fmt: str) -> None:
    from peft import PeftModel

    model = apply_lora(_load(tiny_model_dir, fmt), LoraSettings(r=4, alpha=8))
    with torch.no_grad():  # make the adapter non-trivial
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.05)
    model.eval()
    ids = _batch(1)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    model.save_pretrained(str(tmp_path / "adapter"))
    reloaded = PeftModel.from_pretrained(_load(tiny_model_dir, fmt), str(tmp_path / "adapter"))
    reloaded.eval()
    with torch.no_grad():
        got = reloaded(input_ids=ids).logits
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        with reloaded.disable_adapter():
            base = reloaded(input_ids=ids).logits
    assert not torch.allclose(base, expected, atol=1e-4)


def test_gradient_checkpointing_flag(tiny_model_dir: Path) -> None:
    model = apply_lora(_load(tiny_model_dir, "nvfp4"), gradient_checkpointing=True)
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    model.train()
    ids = _batch()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(
        p.grad is not None
        for n, p in model.named_parameters()
        if ".lora_A." in n or ".lora_B." in n
    )
