"""Fixtures of the training-core tests: tiny policies built through ``build_policy`` and prompt tables."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import torch

torch.set_num_threads(1)

#: EOS ids that end about one sampled token in eight (1 = the tokenizer's own <eos>).
MANY_EOS = (1, *range(20, 27))

#: Small LoRA so the tests stay fast; all seven projections are still wrapped.
LORA = {"r": 4, "alpha": 8}


def randomize_lora(policy, seed: int = 0, std: float = 0.05) -> None:
    """Give the adapter non-zero B matrices (a fresh peft adapter is a no-op: B = 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


@pytest.fixture
def make_policy(tiny_model_dir: Path) -> Callable[..., object]:
    """``make(fmt="nvfp4", lora_seed=None, eos=None) -> Policy`` on CPU/float32.

    ``lora_seed`` randomises the adapter; ``eos`` (token ids) replaces the model config's EOS ids, so
    that a random tiny model ends some completions early (it almost never samples the real EOS).
    """
    from qerl.params import LoraParams, ModelParams, QuantParams
    from qerl.train.policy import build_policy

    def make(fmt: str = "nvfp4", lora_seed: int | None = None, eos: tuple[int, ...] | None = None,
             gradient_checkpointing: bool = False):
        policy, report = build_policy(ModelParams(path=str(tiny_model_dir), device="cpu"), QuantParams(format=fmt),
                                      LoraParams(**LORA), gradient_checkpointing=gradient_checkpointing)
        assert report, "build_policy returned an empty quantization report"
        if lora_seed is not None:
            randomize_lora(policy, lora_seed)
        if eos is not None:
            policy.model.config.eos_token_id = list(eos)
            assert set(policy.eos_token_ids) >= set(eos)
        return policy

    return make


@pytest.fixture
def prompts_table() -> pd.DataFrame:
    """Three prompts of different token lengths (word-level tiny tokenizer: one token per symbol)."""
    return pd.DataFrame(
        {
            "id": ["p0", "p1", "p2"],
            "prompt": ["1 + 2 =", "a b c d e f ?", "7"],
            "answer": ["3", "x", "7"],
            "task": ["add", "letters", "echo"],
            "metadata": ['{"k": 0}', '{"k": 1}', '{"k": 2}'],
        }
    )


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8)
    )


@pytest.fixture
def many_eos() -> tuple[int, ...]:
    return MANY_EOS


@pytest.fixture
def helpers() -> object:
    """Plain helper functions (test modules cannot import each other under importlib mode)."""

    class _H:
        pass

    h = _H()
    h.randomize_lora = randomize_lora  # type: ignore[attr-defined]
    h.snapshot = snapshot  # type: ignore[attr-defined]
    h.bit_equal = bit_equal  # type: ignore[attr-defined]
    return h
