"""The supervised loop: masking, determinism, the shared lr schedule, the stop check and budget."""

from __future__ import annotations

import pytest
import torch

from qerl.embedded.sft import SFTConfig, collate_right, encode_pairs, sft_train
from qerl.embedded.task import EmbeddedTask
from qerl.embedded.warm_start import greedy_completions
from qerl.errors import QerlConfigError
from qerl.modeling.tiny import build_model, build_tokenizer
from qerl.rewards.base import extract_answer

TASK = EmbeddedTask()
PROMPTS = ["47 + 38 =\n", "52 - 38 =\n", "47 - 90 =\n", "10 + 99 =\n", "12 * 3 =\n"]
COMPS = [TASK.completion(a, t) for a, t in
         [("85", "7+8=15,4+3+1=8"), ("14", ""), ("-43", "90-47:10-7=3,9-1-4=4"), ("109", ""), ("36", "")]]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer([p + c for p, c in zip(PROMPTS, COMPS, strict=True)] * 4)


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


def _train(tok, spec, seed, **kw):
    model = build_model(spec, tok, seed=seed)
    cfg = SFTConfig(**{"steps": 150, "batch_size": 5, "lr": 1e-2, "warmup_steps": 5, "schedule": "cosine",
                       "seed": seed, "log_every": 25, "num_threads": 1, **kw})
    return sft_train(model, tok, PROMPTS, COMPS, cfg)


def test_loss_decreases_deterministic_and_memorised(tok, small_spec):
    m1, h1 = _train(tok, small_spec, seed=3)
    assert h1[-1]["loss"] < 0.5 * h1[0]["loss"] and h1[-1]["step"] == 150
    m2, h2 = _train(tok, small_spec, seed=3)
    assert [h["loss"] for h in h1] == [h["loss"] for h in h2]
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters(), strict=True))
    # the memorised pairs come back under greedy decoding through the project's hf engine
    outs = greedy_completions(m1, tok, PROMPTS, max_new_tokens=32)
    assert [extract_answer(o) for o in outs] == [extract_answer(c) for c in COMPS], outs


def test_schedule_is_the_shared_one(tok, small_spec):
    # warm-up over 5 steps then cosine to 0 over 150 (qerl.train.state.build_scheduler)
    _, hist = _train(tok, small_spec, seed=0, steps=150, log_every=1)
    lrs = [h["lr"] for h in hist]
    assert lrs[0] == pytest.approx(1e-2 / 5) and lrs[4] == pytest.approx(1e-2)
    assert lrs[-1] < 1e-4 and all(a >= b for a, b in zip(lrs[4:], lrs[5:], strict=False))


def test_stop_check_and_budget(tok, small_spec):
    model = build_model(small_spec, tok, seed=0)
    calls = []
    cfg = SFTConfig(max_steps=50, batch_size=5, min_steps=10, check_every=5, log_every=7, num_threads=1)
    _, hist = sft_train(model, tok, PROMPTS, COMPS, cfg, should_stop=lambda s: calls.append(s) or s >= 20)
    assert calls == [10, 15, 20] and hist[-1]["step"] == 20
    # never passing: checked up to and at max_steps (27, not a multiple of check_every)
    calls.clear()
    cfg = SFTConfig(max_steps=27, batch_size=5, min_steps=10, check_every=5, num_threads=1)
    _, hist = sft_train(build_model(small_spec, tok, seed=0), tok, PROMPTS, COMPS, cfg, should_stop=lambda s: calls.append(s) and False)
    assert calls == [10, 15, 20, 25, 27] and hist[-1]["step"] == 27
    # a time budget ends training at the first step past it, with a last check there
    calls.clear()
    cfg = SFTConfig(max_steps=500, batch_size=5, min_steps=400, check_every=100, max_seconds=1e-6, num_threads=1)
    _, hist = sft_train(build_model(small_spec, tok, seed=0), tok, PROMPTS, COMPS, cfg, should_stop=lambda s: calls.append(s) and False)
    assert calls == [1] and hist[-1]["step"] == 1


@pytest.mark.parametrize(("field", "value"), [("schedule", "linear"), ("max_steps", 0), ("target_accuracy", 1.5), ("max_seconds", -1.0)])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(QerlConfigError, match=f"embedded_model.sft.{field}"):
        SFTConfig(**{field: value}).validate()
