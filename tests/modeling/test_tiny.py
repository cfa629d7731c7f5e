"""The embedded default model: local tokenizer and tiny config (the warm start: tests/embedded)."""

from __future__ import annotations

import pytest
import torch

from qerl.embedded.task import EmbeddedTask
from qerl.modeling.tiny import (
    FORMAT_TOKENS,
    TinyModelSpec,
    build_config,
    build_model,
    build_tokenizer,
    format_token_ids,
    linear_in_features,
    load_tiny,
    save_tiny,
)

QUESTIONS = [
    "State the final answer to the following arithmetic problem: 47 + 38 =",
    "State the final answer to the following arithmetic problem: 52 - 38 =",
    "State the final answer to the following arithmetic problem: 47 - 90 =",
    "State the final answer to the following arithmetic problem: 10 + 99 =",
    "Calculate 12 * 3.",
]
ANSWERS = ["85", "14", "-43", "109", "36"]
THINKS = ["7+8=15,4+3+1=8", "", "90-47:10-7=3,9-1-4=4", "", ""]
TEXTS = [
    q + "\n" + EmbeddedTask().completion(a, t)
    for q, a, t in zip(QUESTIONS, ANSWERS, THINKS, strict=True)
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TEXTS * 4)


def test_round_trip_and_single_format_tokens(tok):
    samples = TEXTS + ["hé\nllo × 1.5e-3 \t <think></think>", "", " leading and trailing  "]
    for s in samples:
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == s
    ids = format_token_ids(tok)
    assert len(set(ids.values())) == 4
    for t in FORMAT_TOKENS:
        assert tok.convert_ids_to_tokens(ids[t]) == t
    # the tags survive skip_special_tokens (they are not special); pad/eos do not
    c = "<think>1+2=3</think><answer>3</answer>"
    enc = [tok.pad_token_id] + tok.encode(c) + [tok.eos_token_id]
    assert tok.decode(enc, skip_special_tokens=True) == c
    assert tok.pad_token_id != tok.eos_token_id
    # digits are always single tokens
    digit_toks = tok.convert_ids_to_tokens(tok.encode("1234567890"))
    assert digit_toks == list("1234567890")


def test_tokenizer_deterministic_and_compact(tok):
    tok2 = build_tokenizer(TEXTS * 4)
    assert tok2.get_vocab() == tok.get_vocab()
    # boilerplate is merged, so a prompt is short
    assert len(tok.encode(QUESTIONS[0] + "\n")) <= 10


def test_save_load(tmp_path, tok):
    from transformers import AutoTokenizer

    model = build_model(TinyModelSpec(), tok, seed=0)
    save_tiny(model, tok, tmp_path)
    auto = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    m2, t2 = load_tiny(tmp_path)
    for s in TEXTS:
        assert auto.encode(s) == tok.encode(s) == t2.encode(s)
        assert auto.decode(auto.encode(s)) == s
    assert t2.pad_token_id == tok.pad_token_id and t2.eos_token_id == tok.eos_token_id
    x = torch.tensor([tok.encode(TEXTS[0])])
    with torch.no_grad():
        assert torch.equal(model(x).logits, m2(x).logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_config_dims_and_forward(tok, arch):
    spec = TinyModelSpec(architecture=arch)
    cfg = build_config(spec, tok)
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= len(tok)
    model = build_model(spec, tok, seed=0)
    ins = linear_in_features(model)
    assert len(ins) == 7 * spec.num_hidden_layers
    assert all(v % 64 == 0 for v in ins.values()), ins
    assert all(
        m.weight.shape[0] % 16 == 0 for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    ids = torch.randint(0, len(tok), (3, 11))
    out = model(input_ids=ids)
    assert out.logits.shape == (3, 11, cfg.vocab_size)


def test_spec_validation():
    from qerl.errors import QerlConfigError

    with pytest.raises(QerlConfigError, match="hidden_size"):
        TinyModelSpec(hidden_size=100).validate()
    with pytest.raises(QerlConfigError, match="intermediate_size"):
        TinyModelSpec(intermediate_size=300).validate()
