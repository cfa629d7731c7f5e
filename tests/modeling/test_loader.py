"""load_policy_base for every format, streaming FP4 quantization, save/reload of FP4 checkpoints."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from qerl.errors import QerlConfigError
from qerl.modeling.loader import QUANT_FORMATS, load_policy_base, load_quantized, save_quantized
from qerl.quant.linear import QuantLinear, quantize_model_

torch.set_num_threads(1)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _logits(model: nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 12), generator=g).to(next(model.parameters()).device)
    with torch.no_grad():
        return model(input_ids=ids).logits.float().cpu()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _all_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return tensors


# --------------------------------------------------------------------------- validation


def test_bad_model_path(tmp_path: Path) -> None:
    with pytest.raises(QerlConfigError) as info:
        load_policy_base(tmp_path / "nope", "nvfp4")
    assert info.value.field == "model.path"
    with pytest.raises(QerlConfigError, match="config.json"):
        load_policy_base(tmp_path, "none")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(QerlConfigError, match="model.safetensors"):
        load_policy_base(tmp_path, "none")


def test_unknown_format_lists_choices(tiny_model_dir: Path) -> None:
    with pytest.raises(QerlConfigError) as info:
        load_policy_base(tiny_model_dir, "nfvp4")
    assert info.value.field == "quant.format"
    assert all(f in info.value.fix for f in QUANT_FORMATS)


def test_bad_device_dtype_and_mode(tiny_model_dir: Path) -> None:
    with pytest.raises(QerlConfigError, match="model.compute_dtype"):
        load_policy_base(tiny_model_dir, "none", compute_dtype="int8")
    with pytest.raises(QerlConfigError, match="model.device"):
        load_policy_base(tiny_model_dir, "none", device="tpu:7")
    with pytest.raises(QerlConfigError, match="quant.on_indivisible"):
        load_policy_base(tiny_model_dir, "nvfp4", on_indivisible="maybe")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- formats


def test_none_format(tiny_model_dir: Path) -> None:
    model, tok, rows = load_policy_base(tiny_model_dir, "none")
    assert tok.pad_token == "<pad>"
    assert not model.training
    assert {r["format"] for r in rows} == {"fp32"}
    assert all(r["rel_error"] == 0.0 and r["bits_per_weight"] == 32.0 for r in rows)
    assert len(rows) == 2 * 7 + 1


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_streaming_fp4_equals_quantizing_the_full_model(tiny_model_dir: Path, fmt: str) -> None:
    full, _, _ = load_policy_base(tiny_model_dir, "none")
    reference_logits = _logits(full)
    model, _, rows = load_policy_base(tiny_model_dir, fmt)

    tensors = _all_tensors(model)
    assert not [n for n, t in tensors.items() if t.is_meta]
    # rotary buffers are computed as in a normal load
    assert torch.equal(model.model.rotary_emb.inv_freq, full.model.rotary_emb.inv_freq)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings
    assert type(model.lm_head) is nn.Linear
    quantized = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 14

    quantize_model_(full, fmt)
    assert torch.equal(_logits(model), _logits(full))  # same bits as quantizing in memory
    assert _rel(_logits(model), reference_logits) < 0.3  # and within quantization error

    by_name = {r["name"]: r for r in rows}
    assert by_name["lm_head"]["format"] == "fp32" and by_name["lm_head"]["rel_error"] == 0.0
    q = by_name["model.layers.0.mlp.down_proj"]
    assert q["format"] == fmt and q["shape"] == [64, 128]
    assert q["bits_per_weight"] == pytest.approx(4.5 + 32 / (64 * 128) if fmt == "nvfp4" else 4.25)
    assert 0.05 < q["rel_error"] < 0.13


def test_streaming_untied_llama_and_bf16(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory("llama")
    full, _, _ = load_policy_base(path, "none", compute_dtype="bfloat16")
    model, _, _ = load_policy_base(path, "nvfp4", compute_dtype=torch.bfloat16)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, full.lm_head.weight)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_proj.weight_scale.dtype == torch.float8_e4m3fn
    assert _rel(_logits(model), _logits(full)) < 0.3


def test_indivisible_layers_skip_or_error(tiny_model_factory: Callable[..., Path]) -> None:
    path = tiny_model_factory("qwen2", intermediate_size=80)  # down_proj: 80 inputs, 80 % 32 != 0
    with pytest.warns(UserWarning, match="down_proj"):
        model, _, rows = load_policy_base(path, "mxfp4")
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear
    assert isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)
    assert {r["format"] for r in rows if r["name"].endswith("down_proj")} == {"fp32"}
    with pytest.raises(QerlConfigError) as info:
        load_policy_base(path, "mxfp4", on_indivisible="error")
    assert info.value.field == "quant.on_indivisible" and "down_proj" in info.value.problem
    nv, _, _ = load_policy_base(path, "nvfp4", on_indivisible="error")  # 80 % 16 == 0
    assert isinstance(nv.model.layers[0].mlp.down_proj, QuantLinear)


def test_extra_skip_modules(tiny_model_dir: Path) -> None:
    model, _, _ = load_policy_base(
        tiny_model_dir, "nvfp4", skip_modules=("lm_head", "mlp.down_proj")
    )
    assert type(model.model.layers[1].mlp.down_proj) is nn.Linear
    assert isinstance(model.model.layers[1].mlp.up_proj, QuantLinear)


@pytest.mark.parametrize("fmt", ["nf4", "fp4"])
def test_bitsandbytes_formats(tiny_model_dir: Path, fmt: str) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    full, _, _ = load_policy_base(tiny_model_dir, "none")
    model, _, rows = load_policy_base(tiny_model_dir, fmt, bnb_double_quant=True)
    assert isinstance(model.model.layers[0].self_attn.q_proj, bnb.nn.Linear4bit)
    assert type(model.lm_head) is nn.Linear
    q = {r["name"]: r for r in rows}["model.layers.0.self_attn.q_proj"]
    assert q["format"] == fmt and 4.0 < q["bits_per_weight"] < 4.3
    assert 0.05 < q["rel_error"] < 0.15
    assert _rel(_logits(model), _logits(full)) < 0.3


def test_sharded_checkpoint_streams(tiny_model_dir: Path, tmp_path: Path) -> None:
    full, tok, _ = load_policy_base(tiny_model_dir, "none")
    full.save_pretrained(str(tmp_path), max_shard_size="40KB")
    tok.save_pretrained(str(tmp_path))
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded, _, _ = load_policy_base(tmp_path, "mxfp4")
    single, _, _ = load_policy_base(tiny_model_dir, "mxfp4")
    assert torch.equal(_logits(sharded), _logits(single))


# --------------------------------------------------------------------------- save / reload


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_save_and_reload_bit_identical(tiny_model_dir: Path, tmp_path: Path, fmt: str) -> None:
    from safetensors import safe_open

    model, tok, _ = load_policy_base(tiny_model_dir, fmt)
    out = save_quantized(model, tok, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp dirs left behind

    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["format"] == f"{fmt}-pack-quantized"
    assert qc["ignore"] == ["lm_head"]
    assert qc["config_groups"]["group_0"]["weights"]["group_size"] == (16 if fmt == "nvfp4" else 32)
    # stock transformers + compressed-tensors decompress FP4 to bfloat16: the dtype they can run it in
    assert config["dtype"] == "bfloat16" and config["qerl_quantization"]["dtype"] == "float32"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert (
            f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").dtype
            == model.model.layers[0].self_attn.q_proj.weight_scale.dtype
        )
    assert "model.layers.0.self_attn.q_proj.weight_packed" in keys
    assert ("model.layers.0.self_attn.q_proj.weight_global_scale" in keys) == (fmt == "nvfp4")
    assert "model.layers.0.self_attn.q_proj.weight" not in keys
    assert "lm_head.weight" not in keys  # tied: stored once

    again, tok2 = load_quantized(out, "cpu")
    assert tok2 is not None and tok2.pad_token == tok.pad_token
    before, after = _all_tensors(model), _all_tensors(again)
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert t.dtype == after[name].dtype, name
        assert torch.equal(_bits(t), _bits(after[name])), name
    assert again.lm_head.weight is again.model.embed_tokens.weight
    assert torch.equal(_logits(again), _logits(model))

    # saving again over the same directory replaces it (here without a tokenizer) atomically
    save_quantized(again, None, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert not (out / "tokenizer_config.json").exists()
    assert load_quantized(out)[1] is None


def test_quantized_tied_lm_head_round_trip(tiny_model_dir: Path, tmp_path: Path) -> None:
    # lm_head not skipped: it is quantized from the (tied) input embedding, which stays full
    model, tok, rows = load_policy_base(tiny_model_dir, "nvfp4", skip_modules=())
    assert isinstance(model.lm_head, QuantLinear)
    assert {r["name"]: r for r in rows}["lm_head"]["rel_error"] < 0.13
    full, _, _ = load_policy_base(tiny_model_dir, "none")
    quantize_model_(full, "nvfp4", skip_modules=())
    assert torch.equal(_logits(model), _logits(full))
    out = save_quantized(model, tok, tmp_path / "q")
    assert json.loads((out / "config.json").read_text())["quantization_config"]["ignore"] == []
    again, _ = load_quantized(out)
    assert isinstance(again.lm_head, QuantLinear)
    assert torch.equal(_logits(again), _logits(model))


def test_load_quantized_refuses_plain_checkpoints(tiny_model_dir: Path) -> None:
    with pytest.raises(QerlConfigError, match="save_quantized"):
        load_quantized(tiny_model_dir)


def test_save_quantized_refuses_unquantized(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, tok, _ = load_policy_base(tiny_model_dir, "none")
    with pytest.raises(ValueError, match="no QuantLinear"):
        save_quantized(model, tok, tmp_path / "x")
    assert not list(tmp_path.iterdir())


# --------------------------------------------------------------------------- accelerator


@CUDA
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_cuda_streaming_matches_cpu(tiny_model_dir: Path, tmp_path: Path, fmt: str) -> None:
    cpu, _, _ = load_policy_base(tiny_model_dir, fmt)
    gpu, tok, _ = load_policy_base(tiny_model_dir, fmt, device="cuda", compute_dtype="float32")
    assert all(t.device.type == "cuda" for t in _all_tensors(gpu).values())
    for name, t in _all_tensors(cpu).items():
        if name.endswith(("weight_packed", "weight_scale", "weight_global_scale")):
            assert torch.equal(_bits(t), _bits(_all_tensors(gpu)[name].cpu())), name
    assert _rel(_logits(gpu), _logits(cpu)) < 1e-4
    again, _ = load_quantized(save_quantized(gpu, tok, tmp_path / "g"), "cuda")
    assert torch.equal(_logits(again), _logits(gpu))
