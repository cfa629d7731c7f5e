"""Shared test fixtures: tiny random causal LMs (with a local tokenizer) saved to disk."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("KEDRO_DISABLE_TELEMETRY", "1")

TINY_VOCAB = 64


def file_scheduling(dist: str, args: list[str]) -> str:
    """xdist's scheduling for this suite: ``loadfile`` where ``-n N`` alone picked per-test
    ``load``. Some files run their tests in order on shared state (tests/test_cli.py is one CLI
    scenario: the notebook test reads what the training tests wrote), so a file must stay on one
    worker; a ``--dist`` the caller gives is kept."""
    given = any(a == "--dist" or a.startswith("--dist=") for a in args)
    return "loadfile" if dist == "load" and not given else dist


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "dist"):  # pytest-xdist loaded (the scheduler is made after this)
        config.option.dist = file_scheduling(config.option.dist, list(config.invocation_params.args))


def _tiny_tokenizer():  # -> PreTrainedTokenizerFast
    """A word-level tokenizer over 64 symbols (specials, digits, letters, punctuation)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = ["<pad>", "<eos>", "<unk>"] + list("0123456789") + list("abcdefghijklmnopqrstuvwxyz")
    symbols += list("+-*/=()<>.,:;?!") + ["<think>", "</think>", "<answer>", "</answer>"]
    symbols += [f"<extra{i}>" for i in range(TINY_VOCAB - len(symbols))]
    vocab = {s: i for i, s in enumerate(symbols[:TINY_VOCAB])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )


def tiny_config(arch: str = "qwen2", **overrides: object):  # -> Qwen2Config | LlamaConfig
    """A random 2-layer config of ``arch`` ("qwen2" or "llama"): hidden 64, MLP 128, vocab 64, pad 0;
    Qwen2 ties its embeddings and has q/k/v biases, Llama does not tie. ``overrides`` go to the config."""
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, object] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    if arch == "qwen2":
        return Qwen2Config(**{**common, "tie_word_embeddings": True, **overrides})
    if arch == "llama":
        return LlamaConfig(**{**common, "tie_word_embeddings": False, **overrides})
    raise ValueError(f"unknown arch {arch!r}")


def make_tiny_causal_lm(
    path: Path, arch: str = "qwen2", seed: int = 0, **overrides: object
) -> Path:
    """Save a random model of :func:`tiny_config` and a tokenizer to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path))
    _tiny_tokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_config_factory() -> Callable[..., object]:
    """``factory(arch="qwen2", **config_overrides)``: :func:`tiny_config` for tests."""
    return tiny_config


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``factory(arch="qwen2", **config_overrides) -> Path``: a fresh tiny model directory."""

    def factory(arch: str = "qwen2", seed: int = 0, **overrides: object) -> Path:
        return make_tiny_causal_lm(tmp_path_factory.mktemp(f"tiny-{arch}"), arch, seed, **overrides)

    return factory


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    """A tiny tied-embedding Qwen2 model directory (read-only: do not modify it in tests)."""
    return tiny_model_factory("qwen2")
