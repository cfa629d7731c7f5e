"""AQN injection on a tiny random Qwen2: noise really changes log-probs, and never leaks."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from qerl.errors import QerlConfigError
from qerl.noise.aqn import aqn_noise, find_aqn_targets, noise_generator

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                      max_position_embeddings=32)
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def input_ids():
    return torch.arange(12).reshape(2, 6) % 64


def logprobs(model, input_ids):
    with torch.no_grad():
        return torch.log_softmax(model(input_ids=input_ids).logits, -1)


def norm_weights(model):
    return {name: w.detach().clone() for name, w in find_aqn_targets(model)}


def assert_restored(model, saved):
    for name, w in find_aqn_targets(model):
        assert torch.equal(w, saved[name]), name


def test_targets_by_attribute_name(model):
    names = [name for name, _ in find_aqn_targets(model)]
    assert names == ["model.layers.0.input_layernorm", "model.layers.0.post_attention_layernorm",
                     "model.layers.1.input_layernorm", "model.layers.1.post_attention_layernorm"]


def test_noise_changes_logprobs_and_restores(model, input_ids):
    clean = logprobs(model, input_ids)
    saved = norm_weights(model)
    with aqn_noise(model, 1e-2, noise_generator(0, 5)) as info:
        noisy = logprobs(model, input_ids)
    assert info.num_modules == 4 and info.num_elements == 4 * 64 and info.changed_fraction == 1.0
    assert (noisy - clean).abs().max() > 1e-4
    assert_restored(model, saved)
    assert torch.equal(logprobs(model, input_ids), clean)


def test_restored_after_exception(model):
    saved = norm_weights(model)
    with pytest.raises(RuntimeError, match="boom"):
        with aqn_noise(model, 0.1, noise_generator(0, 1)):
            raise RuntimeError("boom")
    assert_restored(model, saved)
    with aqn_noise(model, 0.1, noise_generator(0, 1)):  # usable again after the exception
        pass


def test_redraws_differ_and_do_not_accumulate(model):
    saved = norm_weights(model)
    gen = torch.Generator().manual_seed(123)
    draws = []
    for _ in range(5):  # one generator: its state advances between entries
        with aqn_noise(model, 1e-2, gen):
            draws.append({n: w.detach() - saved[n] for n, w in find_aqn_targets(model)})
    for a, b in zip(draws, draws[1:], strict=False):
        assert not torch.equal(a["model.layers.0.input_layernorm"],
                               b["model.layers.0.input_layernorm"])
    # no accumulation: every draw is a fresh N(0, sigma^2) around the clean weights
    for d in draws:
        spread = torch.cat(list(d.values())).std().item()
        assert 0.5e-2 < spread < 2e-2
    # each target gets its own independent draw
    first = draws[0]
    assert not torch.equal(first["model.layers.0.input_layernorm"],
                           first["model.layers.1.input_layernorm"])
    assert_restored(model, saved)


def test_same_seed_same_noise(model):
    with aqn_noise(model, 1e-2, noise_generator(7, 3)):
        a = norm_weights(model)
    with aqn_noise(model, 1e-2, noise_generator(7, 3)):
        b = norm_weights(model)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_sigma_zero_is_noop_and_nesting_refused(model):
    saved = norm_weights(model)
    with aqn_noise(model, 0.0) as info:
        assert info.num_modules == 0
        assert_restored(model, saved)
    with aqn_noise(model, 1e-2):
        with pytest.raises(QerlConfigError, match="already inside"):
            with aqn_noise(model, 1e-2):
                pass
    assert_restored(model, saved)
    with pytest.raises(QerlConfigError, match="noise.sigma"):
        with aqn_noise(model, -1.0):
            pass


def test_no_target_names_model_class():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(8)

    with pytest.raises(QerlConfigError, match="Plain"):
        with aqn_noise(Plain(), 1e-2):
            pass


def test_through_peft_lora(model, input_ids):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(model),
                                LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"]))
    targets = find_aqn_targets(peft_model)
    assert len(targets) == 4
    assert all(name.startswith("base_model.model.model.layers.") for name, _ in targets)
    clean = logprobs(peft_model, input_ids)
    saved = norm_weights(peft_model)
    with aqn_noise(peft_model, 1e-2, noise_generator(0, 0)) as info:
        noisy = logprobs(peft_model, input_ids)
    assert info.num_modules == 4
    assert (noisy - clean).abs().max() > 1e-4
    assert_restored(peft_model, saved)


class _Layer(nn.Module):
    """A hand-made decoder layer: only the child *names* make it an AQN target."""

    def __init__(self, mlp_norm: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(64, dtype=dtype)
        self.post_attention_layernorm = nn.RMSNorm(64, dtype=dtype)
        if mlp_norm == "pre_feedforward_layernorm":
            self.pre_feedforward_layernorm = nn.RMSNorm(64, dtype=dtype)


def test_gemma_style_layer_uses_pre_feedforward_norm():
    layers = nn.ModuleList([_Layer("pre_feedforward_layernorm", torch.float32)])
    assert [n for n, _ in find_aqn_targets(layers)] == ["0.input_layernorm",
                                                        "0.pre_feedforward_layernorm"]


def test_bf16_rounding_is_reported():
    layers = nn.ModuleList([_Layer("post_attention_layernorm", torch.bfloat16)])
    with aqn_noise(layers, 5e-4, noise_generator(0, 0)) as small:
        pass
    with aqn_noise(layers, 5e-2, noise_generator(0, 0)) as large:
        pass
    # bf16 spacing just below 1 is 2^-8 ~ 3.9e-3: most of a 5e-4 perturbation rounds away
    assert small.changed_fraction < 0.3 < 0.9 < large.changed_fraction
    assert all(torch.equal(w, torch.ones(64, dtype=torch.bfloat16))
               for _, w in find_aqn_targets(layers))
