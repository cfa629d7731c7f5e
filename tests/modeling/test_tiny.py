"""The embedded default model: local tokenizer, tiny config, SFT warm start, greedy evaluation."""

from __future__ import annotations

import pytest
import torch

from qerl.modeling.sft import (
    EmbeddedTask,
    SFTConfig,
    collate_right,
    column_scratchpad,
    embedded_warm_start,
    encode_pairs,
    extract_answer,
    greedy_accuracy,
    sft_train,
)
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
    q + "\n" + EmbeddedTask.completion(a, t)
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


def test_column_scratchpad():
    assert column_scratchpad("47 + 38") == "7+8=15,4+3+1=8"
    assert column_scratchpad("52 - 38") == "12-8=4,5-1-3=1"
    assert column_scratchpad("47 - 90") == "90-47:10-7=3,9-1-4=4"
    assert column_scratchpad("1 * 2") is None


def test_collate_masks_prompt(tok):
    p, c = encode_pairs(tok, ["ab\n", "abcd\n"], ["<answer>1</answer>", "<answer>22</answer>"])
    assert c[0][-1] == tok.eos_token_id
    ids, att, lab = collate_right(p, c, tok.pad_token_id)
    for i in range(2):
        n_p, n_c = len(p[i]), len(c[i])
        assert (lab[i, :n_p] == -100).all()
        assert lab[i, n_p : n_p + n_c].tolist() == c[i]
        assert (lab[i, n_p + n_c :] == -100).all()
        assert att[i].sum() == n_p + n_c


def _small_spec() -> TinyModelSpec:
    """The one-layer, hidden-64 model the SFT tests train (seconds on a CPU)."""
    return TinyModelSpec(hidden_size=64, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=128, num_hidden_layers=1)


def _tiny_sft(tok, seed):
    spec = _small_spec()
    model = build_model(spec, tok, seed=seed)
    prompts = [t.split("\n")[0] + "\n" for t in TEXTS]
    comps = [t.split("\n", 1)[1] for t in TEXTS]
    cfg = SFTConfig(
        steps=150,
        batch_size=5,
        lr=1e-2,
        warmup_steps=5,
        schedule="cosine",
        seed=seed,
        log_every=25,
        num_threads=1,
    )
    return sft_train(model, tok, prompts, comps, cfg), prompts, comps


def test_sft_loss_decreases_and_is_deterministic(tok):
    (m1, h1), prompts, comps = _tiny_sft(tok, seed=3)
    assert h1[-1]["loss"] < 0.5 * h1[0]["loss"]
    assert h1[-1]["step"] == 150
    (m2, h2), _, _ = _tiny_sft(tok, seed=3)
    assert [h["loss"] for h in h1] == [h["loss"] for h in h2]
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b)
    # the memorised training set is solved greedily, batched with left padding
    answers = [extract_answer(c) for c in comps]
    acc, outs = greedy_accuracy(m1, tok, prompts, answers, max_new_tokens=32, batch_size=2)
    assert acc == 1.0, outs


def test_extract_answer():
    assert extract_answer("<think>x</think><answer> 42 </answer>") == "42"
    assert extract_answer("<answer>1</answer><answer>2</answer>") == "2"
    assert extract_answer("no tags") is None


def test_embedded_task_splits_and_warm_start():
    task = EmbeddedTask()
    small = _small_spec()
    ws = embedded_warm_start(
        task,
        small,
        SFTConfig(
            max_steps=12,
            batch_size=8,
            num_threads=1,
            min_steps=4,
            check_every=4,
            target_accuracy=2.0,
        ),
        sizes={"sft": 200, "val": 20, "rl": 50, "eval": 50},
        seed=0,
    )
    # an unreachable target: checked at 4, 8, 12 and never stops early
    assert [s for s, _ in ws.val_curve] == [4, 8, 12] and ws.steps == 12
    qs = {k: {e["question"] for e in v} for k, v in ws.splits.items()}
    assert [len(qs[k]) for k in ("sft", "val", "rl", "eval")] == [200, 20, 50, 50]
    assert not (qs["val"] & (qs["sft"] | qs["rl"] | qs["eval"]))
    assert (
        not (qs["sft"] & qs["eval"]) and not (qs["rl"] & qs["eval"]) and not (qs["sft"] & qs["rl"])
    )
    prompts, comps = task.sft_pairs(ws.splits["sft"], seed=1234)
    n_scratch = sum("<think></think>" not in c for c in comps)
    assert 0.15 < n_scratch / len(comps) < 0.45
    score = task.scorer()
    for e, c in zip(
        ws.splits["sft"], comps, strict=True
    ):  # every target is correct per the verifier
        assert score(extract_answer(c), e) == 1.0
        if "<think></think>" not in c:
            assert c.startswith("<think>" + column_scratchpad(e["metadata"]["expression"]))
    # the prompt + completion (+ EOS) stays short
    tok = ws.tokenizer
    assert max(len(tok.encode(p + c)) for p, c in zip(prompts, comps, strict=True)) + 1 <= 40
    assert len(ws.history) >= 1


def test_sft_early_stop(tok):
    spec = _small_spec()
    model = build_model(spec, tok, seed=0)
    prompts = [t.split("\n")[0] + "\n" for t in TEXTS]
    comps = [t.split("\n", 1)[1] for t in TEXTS]
    calls = []
    cfg = SFTConfig(
        max_steps=50, batch_size=5, min_steps=10, check_every=5, log_every=7, num_threads=1
    )
    _, hist = sft_train(
        model, tok, prompts, comps, cfg, should_stop=lambda s: calls.append(s) or s >= 20
    )
    assert calls == [10, 15, 20]
    assert hist[-1]["step"] == 20
