"""Random-init models of real architectures, built and quantized one layer at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from qerl.errors import QerlConfigError
from qerl.modeling.loader import load_policy_base
from qerl.modeling.lora import apply_lora
from qerl.modeling.random_init import QWEN25, build_random_policy_base, qwen25_config
from qerl.params import LoraParams
from qerl.quant.linear import QuantLinear, quantize_model_

torch.set_num_threads(1)


@pytest.fixture
def tiny_config(tiny_config_factory):
    """The shared tiny Qwen2 config (tests/conftest.py) with vocabulary 80."""
    return lambda **over: tiny_config_factory("qwen2", **{"vocab_size": 80, **over})


def _bits(model: nn.Module) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    return {k: v.detach().contiguous().reshape(-1).view(torch.uint8) for k, v in state.items()}


def _same_bits(a: nn.Module, b: nn.Module) -> bool:
    x, y = _bits(a), _bits(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


# Parameter totals the Hugging Face hub shows for the Qwen2.5 checkpoints (billions, rounded as
# there; computed from their safetensors headers, so independent of transformers' config code).
HUB_PARAMS = {
    "qwen2.5-0.5b": 0.49,
    "qwen2.5-1.5b": 1.54,
    "qwen2.5-3b": 3.09,
    "qwen2.5-7b": 7.62,
    "qwen2.5-14b": 14.8,
    "qwen2.5-32b": 32.8,
    "qwen2.5-72b": 72.7,
}


@pytest.mark.parametrize("arch", sorted(QWEN25))
def test_presets_have_the_real_parameter_counts(arch: str) -> None:
    from transformers import AutoModelForCausalLM

    config = qwen25_config(arch)
    assert config.vocab_size == (151936 if config.tie_word_embeddings else 152064)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters()) / 1e9
    digits = 2 if HUB_PARAMS[arch] < 10 else 1
    assert round(n, digits) == HUB_PARAMS[arch]


def test_72b_preset_shape() -> None:
    c = qwen25_config("qwen2.5-72b")
    shape = (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads)
    assert shape + (c.num_key_value_heads,) == (8192, 29568, 80, 64, 8)
    assert not c.tie_word_embeddings
    with pytest.raises(ValueError, match="qwen2.5-7b"):
        qwen25_config("qwen2.5-8b")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_every_linear_but_lm_head_is_quantized_and_logits_are_finite(fmt: str, tiny_config) -> None:
    if fmt == "nf4":
        bnb = pytest.importorskip("bitsandbytes")
        quant_type: type = bnb.nn.Linear4bit
    else:
        quant_type = QuantLinear
    model = build_random_policy_base(tiny_config(), fmt, "cpu", torch.bfloat16, seed=0)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert type(linears.pop("lm_head")) is nn.Linear
    assert len(linears) == 14 and all(type(m) is quant_type for m in linears.values())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not [n for n, t in model.state_dict().items() if t.is_meta]
    assert not model.training
    with torch.no_grad():
        logits = model(input_ids=torch.arange(12).reshape(2, 6) % 80).logits
    assert logits.shape == (2, 6, 80) and torch.isfinite(logits).all()
    assert logits.float().std() > 0


def test_initialisation_follows_the_config(tiny_config) -> None:
    model = build_random_policy_base(
        tiny_config(initializer_range=0.05), "none", "cpu", torch.float32
    )
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight.std().item() == pytest.approx(0.05, rel=0.1)
    assert torch.equal(q.bias, torch.zeros(64))
    assert torch.equal(model.model.norm.weight, torch.ones(64))
    emb = model.model.embed_tokens.weight
    assert torch.equal(emb[0], torch.zeros(64)) and emb[1:].std().item() == pytest.approx(
        0.05, rel=0.1
    )


def test_deterministic_for_a_seed(tiny_config) -> None:
    a = build_random_policy_base(tiny_config(), "nvfp4", seed=3)
    b = build_random_policy_base(tiny_config(), "nvfp4", seed=3)
    c = build_random_policy_base(tiny_config(), "nvfp4", seed=4)
    assert _same_bits(a, b)
    assert not _same_bits(a, c)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_build_equals_quantizing_the_full_precision_build(fmt: str, tiny_config) -> None:
    reference = build_random_policy_base(tiny_config(), "none", dtype=torch.float32, seed=5)
    quantize_model_(reference, fmt)
    built = build_random_policy_base(tiny_config(), fmt, dtype=torch.float32, seed=5)
    assert _same_bits(built, reference)


def test_nf4_build_equals_a_transformers_bitsandbytes_load(tiny_model_dir: Path, tmp_path: Path, tiny_config) -> None:
    pytest.importorskip("bitsandbytes")
    from transformers import AutoTokenizer

    full = build_random_policy_base(tiny_config(vocab_size=64), "none", dtype=torch.float32, seed=6)
    full.save_pretrained(str(tmp_path))
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(str(tmp_path))
    loaded, _, _ = load_policy_base(tmp_path, "nf4", compute_dtype=torch.float32)
    built = build_random_policy_base(tiny_config(vocab_size=64), "nf4", dtype=torch.float32, seed=6)
    x, y = _bits(built), _bits(loaded)
    assert x.keys() == y.keys()
    for key in x:
        assert torch.equal(x[key], y[key]), key
    ids = torch.arange(10).reshape(2, 5)
    with torch.no_grad():
        assert torch.equal(built(input_ids=ids).logits, loaded(input_ids=ids).logits)


def test_tied_lm_head_can_be_quantized_too(tiny_config) -> None:
    model = build_random_policy_base(tiny_config(), "nvfp4", skip_modules=(), seed=1)
    assert isinstance(model.lm_head, QuantLinear)
    reference = build_random_policy_base(tiny_config(), "none", seed=1)
    quantize_model_(reference, "nvfp4", skip_modules=())
    assert _same_bits(model, reference)


def test_ready_for_lora_training(tiny_config) -> None:
    model = build_random_policy_base(tiny_config(), "nvfp4", dtype=torch.float32, seed=2)
    peft_model = apply_lora(model, LoraParams(r=4, alpha=8))
    ids = torch.arange(12).reshape(2, 6) % 80
    loss = peft_model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for n, p in peft_model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None for g in grads)


def test_bad_arguments_fail_before_building(tiny_config) -> None:
    with pytest.raises(QerlConfigError, match="quant.format"):
        build_random_policy_base(tiny_config(), "int3")
    with pytest.raises(QerlConfigError, match="model.device"):
        build_random_policy_base(tiny_config(), "nvfp4", device="tpu:0")
    with pytest.raises(QerlConfigError, match="quant.on_indivisible"):
        build_random_policy_base(tiny_config(intermediate_size=80), "mxfp4", on_indivisible="error")


@pytest.mark.parametrize("real_vocab", [False, True])
def test_written_random_model_loads_with_the_chosen_vocabulary(real_vocab: bool, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``make_random_model`` (the GPU preset's model): the small tokenizer either way, the
    vocabulary its own size or the architecture's (ids past the tokenizer decode to nothing)."""
    from transformers import AutoTokenizer

    from qerl.modeling import random_init
    from qerl.modeling.tiny import VOCAB_MULTIPLE, round_up

    monkeypatch.setitem(random_init.QWEN25, "qwen2.5-test", (64, 128, 2, 4, 2, 1000, False, 1e-6))
    out = random_init.make_random_model("qwen2.5-test", tmp_path / "m", real_vocab=real_vocab)
    tok = AutoTokenizer.from_pretrained(out)
    base = load_policy_base(out, "none", device="cpu", compute_dtype=torch.float32)[0]
    vocab = base.get_output_embeddings().weight.shape[0]
    assert vocab == (1000 if real_vocab else round_up(len(tok), VOCAB_MULTIPLE))
    assert len(tok) < vocab
    assert tok.decode([5, vocab - 1], skip_special_tokens=True) == tok.decode([5], skip_special_tokens=True)
