"""The three RL step stages (rollout, score, update) and the prompt helpers, on tiny CPU policies.

The central property checked here is that the log-probs the rollout engine records are the ones the
trainer recomputes (``make_batch`` + ``sequence_logprobs``): without AQN noise the
"rollout vs trainer gap" must be ~0, for a plain and a 4-bit (nvfp4) base with a non-zero LoRA
adapter, with prompts of different lengths in one batch.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch

from qerl.noise.aqn import find_aqn_targets
from qerl.rewards.base import build_rewards, register_reward
from qerl.rl.objective import ObjectiveConfig
from qerl.rollout.base import SamplingParams
from qerl.rollout.hf import HFGenerateEngine
from qerl.train.run import start_run
from qerl.train.steps import (
    NonFiniteError,
    RolloutConfig,
    UpdateConfig,
    _mix,  # the update's minibatch order, to place a bad row last
    encode_prompts,
    make_batch,
    rollout_step,
    score_step,
    select_prompts,
    sequence_logprobs,
    update_step,
)

PROMPT_IDS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [3]]

ROLLOUT_COLUMNS = [
    "step", "prompt_id", "sample", "prompt", "completion", "prompt_ids", "completion_ids", "logprobs",
    "prompt_tokens", "completion_tokens", "truncated", "sum_logprob", "mean_entropy", "sigma", "answer",
    "task", "metadata", "generate_seconds", "prompts_truncated", "prompts_dropped",
]

METRIC_KEYS = [
    "reward_mean", "reward_std", "zero_std_group_frac", "completion_len_mean", "completion_len_max",
    "truncated_ratio", "entropy", "clip_ratio_low", "clip_ratio_high", "loss", "grad_norm", "lr", "sigma",
    "logprob_gap_mean", "logprob_gap_max", "kl_to_base", "t_generate", "t_score", "t_update", "tokens_per_s",
    "peak_mem_gib",
]


def _value_reward(scale: float = 1.0):
    """Reward = the completion parsed as a number (test-only registration)."""

    def fn(prompts, completions, **columns):
        return [scale * float(c) for c in completions]

    return fn


def _text_len_reward():
    def fn(prompts, completions, **columns):
        return [float(len(c)) for c in completions]

    return fn


def _metadata_reward():
    def fn(prompts, completions, metadata=None, **columns):
        if metadata is None:
            return [0.0] * len(completions)
        return [float(m.get("bonus", 0)) for m in metadata]

    return fn


TEST_REWARDS = {"test_value": _value_reward, "test_text_len": _text_len_reward, "test_metadata_bonus": _metadata_reward}


@pytest.fixture(scope="module", autouse=True)
def _registered_test_rewards():
    """Register the test-only rewards for this module, and take them out of the registry afterwards."""
    from qerl.rewards import base

    for name, factory in TEST_REWARDS.items():
        register_reward(name)(factory)
    yield
    for name in TEST_REWARDS:
        base._REGISTRY.pop(name, None)


# ------------------------------------------------------------------ helpers


def _recomputed_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[token] of every completion token from one unpadded forward pass."""
    seq = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def _rcfg(**kw) -> RolloutConfig:
    base = dict(group_size=4, temperature=1.0, max_new_tokens=6, max_prompt_tokens=32)
    base.update(kw)
    return RolloutConfig(**base)


def _trainer_logprobs(policy, table: pd.DataFrame, temperature: float):
    rows = table.assign(advantage=0.0)
    batch = make_batch(rows, policy.pad_token_id, policy.device)
    with torch.no_grad():
        logp, _ = sequence_logprobs(policy.model, batch, temperature)
    return logp, batch


def _ucfg(**kw) -> UpdateConfig:
    base = dict(objective=ObjectiveConfig(loss_type="dapo"), max_grad_norm=1.0, max_bad_steps=3, seed=0)
    base.update(kw)
    return UpdateConfig(**base)


def _state(policy, tmp_path, lr: float = 1e-2, steps_per_step: int = 1):
    return start_run(
        policy, run_name="t", fingerprint="fp", total_steps=10, save_every=100, optimizer="adamw", lr=lr,
        weight_decay=0.0, warmup_ratio=0.0, lr_schedule="constant", optimizer_steps_per_step=steps_per_step,
        noise=None, checkpoint_root=tmp_path / "ckpt", resume="never",
    )


def _scored(policy, prompts: pd.DataFrame, step: int = 1, sigma: float = 0.0, group: int = 4) -> pd.DataFrame:
    """Real rollouts + real scoring; advantages then set to fixed +-1 so every group carries signal."""
    rollouts = rollout_step(policy, prompts, step, sigma, _rcfg(group_size=group), HFGenerateEngine(), seed=0)
    scored = score_step(rollouts, build_rewards([{"name": "test_text_len"}]), group)
    scored["advantage"] = [1.0 if i % 2 == 0 else -1.0 for i in range(len(scored))]
    return scored


def _lora_and_base(policy):
    lora = {k: v.detach().clone() for k, v in policy.model.state_dict().items() if "lora_" in k}
    base = {k: v.detach().clone() for k, v in policy.model.state_dict().items() if "lora_" not in k}
    return lora, base


# ------------------------------------------------------------------ select / encode


def _prompt_frame(n: int) -> pd.DataFrame:
    return pd.DataFrame({"id": [f"q{i}" for i in range(n)], "prompt": [f"p{i}" for i in range(n)], "answer": "0"})


def test_select_prompts_is_deterministic_and_covers_each_epoch() -> None:
    table = _prompt_frame(10)
    a = select_prompts(table, step=3, per_step=4, seed=7)
    pd.testing.assert_frame_equal(a, select_prompts(table, step=3, per_step=4, seed=7))
    assert len(a) == 4 and list(a.index) == [0, 1, 2, 3]
    assert list(a.columns) == list(table.columns)

    # per_step divides n: steps 1-2 are epoch 0, steps 3-4 epoch 1; each covers every prompt once
    for first in (1, 3):
        ids = [i for s in (first, first + 1) for i in select_prompts(table, s, 5, seed=7)["id"]]
        assert sorted(ids) == sorted(table["id"]), ids
    # per_step does not divide n: 5 steps of 4 = 2 full epochs, the slices straddle the boundary
    ids = [i for s in range(1, 6) for i in select_prompts(table, s, 4, seed=3)["id"]]
    assert sorted(ids[:10]) == sorted(table["id"]) and sorted(ids[10:]) == sorted(table["id"])

    epoch0 = lambda seed: [i for s in (1, 2) for i in select_prompts(table, s, 5, seed)["id"]]  # noqa: E731
    assert epoch0(0) != epoch0(1)
    assert epoch0(0) == epoch0(0)
    # rows are the table's rows (all columns carried along)
    row = a.iloc[0]
    assert table.set_index("id").loc[row["id"], "prompt"] == row["prompt"]


def test_encode_prompts_truncates_keeping_the_end_or_drops(make_policy, prompts_table) -> None:
    policy = make_policy("nvfp4")
    texts = ["a b c d e f g h", "a b", "1 2 3 4 5"]
    full = [policy.tokenizer(t, add_special_tokens=True)["input_ids"] for t in texts]
    assert [len(f) for f in full] == [8, 2, 5]

    ids, kept, n_trunc, n_drop = encode_prompts(policy, texts, max_tokens=4, overlong="truncate")
    assert kept == [0, 1, 2] and (n_trunc, n_drop) == (2, 0)
    assert ids == [full[0][-4:], full[1], full[2][-4:]]
    assert policy.tokenizer.convert_ids_to_tokens(ids[0]) == ["e", "f", "g", "h"]

    ids, kept, n_trunc, n_drop = encode_prompts(policy, texts, max_tokens=4, overlong="drop")
    assert kept == [1] and ids == [full[1]] and (n_trunc, n_drop) == (0, 2)

    ids, kept, n_trunc, n_drop = encode_prompts(policy, texts, max_tokens=8, overlong="drop")
    assert kept == [0, 1, 2] and ids == full and (n_trunc, n_drop) == (0, 0)

    long_only = prompts_table.assign(prompt=["a b c d e f g h", "1 2 3 4 5 6", "x y z w v"])
    with pytest.raises(ValueError, match=r"rollout\.max_prompt_tokens"):
        rollout_step(policy, long_only, 1, 0.0, _rcfg(max_prompt_tokens=3, overlong_prompt="drop"),
                     HFGenerateEngine(), seed=0)


def test_rollout_step_counts_truncated_and_dropped_prompts(make_policy, prompts_table) -> None:
    policy = make_policy("nvfp4")
    # prompt token counts: 4, 7, 1
    table = rollout_step(policy, prompts_table, 1, 0.0, _rcfg(max_prompt_tokens=4, group_size=2),
                         HFGenerateEngine(), seed=0)
    assert (table["prompts_truncated"] == 1).all() and (table["prompts_dropped"] == 0).all()
    long_rows = table[table["prompt_id"] == "p1"]
    assert all(p == policy.tokenizer("a b c d e f ?")["input_ids"][-4:] for p in long_rows["prompt_ids"])
    assert (long_rows["prompt_tokens"] == 4).all()

    table = rollout_step(policy, prompts_table, 1, 0.0,
                         _rcfg(max_prompt_tokens=4, group_size=2, overlong_prompt="drop"), HFGenerateEngine(), seed=0)
    assert list(table["prompt_id"]) == ["p0", "p0", "p2", "p2"]
    assert (table["prompts_dropped"] == 1).all() and (table["prompts_truncated"] == 0).all()


# ------------------------------------------------------------------ the HF engine


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.3, 0.8)])
def test_hf_engine_shapes_eos_mask_and_logprobs(make_policy, temperature: float, top_p: float) -> None:
    policy = make_policy("nvfp4", lora_seed=1)
    model = policy.model
    eos = tuple(range(20, 28))  # 8 of 64 tokens end a sequence: a mix of finished and truncated rows
    n, max_new = 3, 8
    sp = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new, eos_token_ids=eos,
                        pad_token_id=0)
    model.train()  # the engine samples in eval mode and gives the model back in the mode it found
    batch = HFGenerateEngine().generate(model, PROMPT_IDS, sp, torch.Generator().manual_seed(0))
    assert model.training
    model.eval()

    N = len(PROMPT_IDS) * n
    T = batch.completion_ids.shape[1]
    assert len(batch) == N
    for t in (batch.completion_ids, batch.completion_mask, batch.logprobs, batch.extras["entropy"]):
        assert tuple(t.shape) == (N, T)
    assert batch.truncated.shape == (N,) and batch.truncated.dtype == torch.bool
    assert batch.prompt_index.tolist() == [i for i in range(len(PROMPT_IDS)) for _ in range(n)]
    assert batch.prompt_ids == [p for p in PROMPT_IDS for _ in range(n)]
    assert 0 < int(batch.truncated.sum()) < N, "seed should give both finished and truncated rows"
    assert T == max_new  # some row ran to the limit

    for i in range(N):
        toks, mask = batch.completion_ids[i].tolist(), batch.completion_mask[i].tolist()
        hits = [j for j, t in enumerate(toks) if t in eos]
        if batch.truncated[i]:
            assert not hits and mask == [1.0] * T
            length = T
        else:
            k = hits[0]
            length = k + 1
            assert mask == [1.0] * length + [0.0] * (T - length)  # up to and including the first EOS
            assert toks[length:] == [0] * (T - length)  # padding after EOS
            assert batch.logprobs[i, length:].abs().sum() == 0
        assert int(batch.completion_lengths[i]) == length
        ref = _recomputed_logprobs(model, batch.prompt_ids[i], toks[:length], temperature)
        torch.testing.assert_close(batch.logprobs[i, :length], ref, atol=1e-4, rtol=0)
        assert (batch.logprobs[i, :length] <= 0).all()

    # same generator seed -> same samples; another seed -> different samples
    again = HFGenerateEngine().generate(model, PROMPT_IDS, sp, torch.Generator().manual_seed(0))
    assert torch.equal(again.completion_ids, batch.completion_ids)
    other = HFGenerateEngine().generate(model, PROMPT_IDS, sp, torch.Generator().manual_seed(1))
    assert not torch.equal(other.completion_ids[:, :3], batch.completion_ids[:, :3])


def test_hf_engine_chunked_batches_agree(make_policy) -> None:
    policy = make_policy("nvfp4", lora_seed=1)
    sp = SamplingParams(n=2, max_new_tokens=6, eos_token_ids=tuple(range(20, 28)), pad_token_id=0, greedy=True)
    whole = HFGenerateEngine().generate(policy.model, PROMPT_IDS, sp)
    chunked = HFGenerateEngine(batch_size=1).generate(policy.model, PROMPT_IDS, sp)
    assert chunked.completion_ids.shape == whole.completion_ids.shape
    assert torch.equal(chunked.completion_ids, whole.completion_ids)
    assert torch.equal(chunked.completion_mask, whole.completion_mask)
    assert torch.equal(chunked.prompt_index, whole.prompt_index)
    torch.testing.assert_close(chunked.logprobs, whole.logprobs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("fmt", ["none", "nvfp4"])
def test_hf_engine_greedy_equals_plain_generate(make_policy, fmt: str) -> None:
    policy = make_policy(fmt, lora_seed=2)
    model = policy.model
    max_new = 10
    eos = (1,)
    sp = SamplingParams(n=2, max_new_tokens=max_new, eos_token_ids=eos, pad_token_id=0, greedy=True)
    batch = HFGenerateEngine().generate(model, PROMPT_IDS, sp)
    for i, prompt in enumerate(PROMPT_IDS):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, eos_token_id=list(eos), pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        if 1 in expected:
            expected = expected[: expected.index(1) + 1]
        for row in (2 * i, 2 * i + 1):  # both greedy samples of the prompt are the argmax path
            n = int(batch.completion_lengths[row])
            assert batch.completion_ids[row, :n].tolist() == expected
            ref = _recomputed_logprobs(model, prompt, expected, 1.0)
            torch.testing.assert_close(batch.logprobs[row, :n], ref, atol=1e-4, rtol=0)


# ------------------------------------------------------------------ rollout_step


@pytest.mark.parametrize("fmt", ["none", "nvfp4"])
def test_rollout_logprobs_equal_trainer_logprobs_without_noise(make_policy, prompts_table, many_eos, fmt: str) -> None:
    policy = make_policy(fmt, lora_seed=3, eos=many_eos)
    temperature = 0.9
    table = rollout_step(policy, prompts_table, 2, 0.0, _rcfg(temperature=temperature), HFGenerateEngine(), seed=5)
    # prompts and completions of different lengths: both paddings of make_batch are exercised
    assert table["prompt_tokens"].nunique() == 3 and table["completion_tokens"].nunique() > 1
    logp, batch = _trainer_logprobs(policy, table, temperature)
    m = batch["mask"].bool()
    assert int(m.sum()) == int(table["completion_tokens"].sum())
    gap = (logp - batch["old_logprobs"]).abs()[m]
    assert float(gap.max()) < 1e-4
    # and every row against an independent unpadded forward pass
    for _, row in table.iterrows():
        ref = _recomputed_logprobs(policy.model, list(row["prompt_ids"]), list(row["completion_ids"]), temperature)
        torch.testing.assert_close(torch.tensor(list(row["logprobs"]), dtype=torch.float32), ref, atol=1e-4, rtol=0)


def test_rollout_step_table(make_policy, prompts_table, many_eos) -> None:
    policy = make_policy("nvfp4", lora_seed=0, eos=many_eos)
    G = 4
    table = rollout_step(policy, prompts_table, 3, 0.0, _rcfg(group_size=G), HFGenerateEngine(), seed=0)
    assert set(ROLLOUT_COLUMNS) <= set(table.columns)
    assert len(table) == len(prompts_table) * G
    assert (table["step"] == 3).all() and (table["sigma"] == 0.0).all()
    assert list(table["prompt_id"]) == [p for p in prompts_table["id"] for _ in range(G)]
    assert list(table["sample"]) == list(range(G)) * len(prompts_table)
    assert list(table["answer"]) == [a for a in prompts_table["answer"] for _ in range(G)]
    assert list(table["prompt"]) == [p for p in prompts_table["prompt"] for _ in range(G)]
    assert list(table["task"]) == [t for t in prompts_table["task"] for _ in range(G)]
    assert [json.loads(m)["k"] for m in table["metadata"]] == [k for k in range(3) for _ in range(G)]
    for _, row in table.iterrows():
        assert list(row["prompt_ids"]) == policy.tokenizer(row["prompt"])["input_ids"]
        assert row["prompt_tokens"] == len(row["prompt_ids"])
        assert row["completion_tokens"] == len(row["completion_ids"]) == len(row["logprobs"]) >= 1
        ends = [t in many_eos for t in row["completion_ids"]]
        assert row["truncated"] == (not any(ends))
        assert row["truncated"] or ends.index(True) == len(ends) - 1  # ends at its first EOS
        assert math.isclose(row["sum_logprob"], float(sum(row["logprobs"])), rel_tol=1e-6, abs_tol=1e-6)
        assert row["mean_entropy"] > 0
        assert "<eos>" not in row["completion"] and "<pad>" not in row["completion"]
    assert 0 < table["truncated"].sum() < len(table)
    assert table.loc[table["truncated"], "completion_tokens"].eq(6).all()
    # deterministic in (seed, step); another step samples differently
    again = rollout_step(policy, prompts_table, 3, 0.0, _rcfg(group_size=G), HFGenerateEngine(), seed=0)
    assert list(again["completion_ids"].map(list)) == list(table["completion_ids"].map(list))
    other = rollout_step(policy, prompts_table, 4, 0.0, _rcfg(group_size=G), HFGenerateEngine(), seed=0)
    assert list(other["completion_ids"].map(list)) != list(table["completion_ids"].map(list))
    # the table survives a parquet round trip (it is persisted by StepTableDataset)
    buf = io.BytesIO()
    table.to_parquet(buf, index=False)
    back = pd.read_parquet(io.BytesIO(buf.getvalue()))
    assert [list(x) for x in back["completion_ids"]] == [list(x) for x in table["completion_ids"]]


def test_rollout_step_noise_reaches_rollouts_and_weights_come_back(make_policy, prompts_table, helpers) -> None:
    policy = make_policy("nvfp4", lora_seed=0)
    before = helpers.snapshot(policy.model)
    norms_before = {n: w.detach().clone() for n, w in find_aqn_targets(policy.model)}
    assert norms_before
    cfg = _rcfg(temperature=1.0)
    clean = rollout_step(policy, prompts_table, 1, 0.0, cfg, HFGenerateEngine(), seed=0)
    noisy = rollout_step(policy, prompts_table, 1, 0.05, cfg, HFGenerateEngine(), seed=0)
    assert (noisy["sigma"] == 0.05).all()
    assert [list(x) for x in noisy["logprobs"]] != [list(x) for x in clean["logprobs"]]
    # the first token of every row is sampled from the same prompt and the same random stream: where
    # clean and noisy picked the same token its log-prob still differs (the norm weights were noised)
    same_first = [(c[0], n[0]) for c, n, a, b in zip(clean["logprobs"], noisy["logprobs"], clean["completion_ids"],
                                                        noisy["completion_ids"], strict=True) if a[0] == b[0]]
    assert same_first and all(abs(c - n) > 1e-6 for c, n in same_first)
    # the clean trainer sees the noisy rollouts with a gap (the gap that sigma = 0 does not have)
    logp, batch = _trainer_logprobs(policy, noisy, 1.0)
    assert float((logp - batch["old_logprobs"]).abs()[batch["mask"].bool()].max()) > 1e-4
    # nothing in the model changed, norm weights included, bit for bit
    after = helpers.snapshot(policy.model)
    assert before.keys() == after.keys()
    assert all(helpers.bit_equal(before[k], after[k]) for k in before)
    for n, w in find_aqn_targets(policy.model):
        assert helpers.bit_equal(w.detach(), norms_before[n])
    # the noisy rollout is reproducible for the same (seed, step)
    noisy2 = rollout_step(policy, prompts_table, 1, 0.05, cfg, HFGenerateEngine(), seed=0)
    assert [list(x) for x in noisy2["logprobs"]] == [list(x) for x in noisy["logprobs"]]


# ------------------------------------------------------------------ score_step


def _synthetic_rollouts() -> pd.DataFrame:
    completions = ["1", "2", "3", "4", "5", "5", "5", "5", "0", "0", "7", "0"]
    answers = ["3"] * 4 + ["0"] * 4 + ["7"] * 4
    return pd.DataFrame(
        {
            "step": 1,
            "prompt_id": [f"g{i // 4}" for i in range(12)],
            "prompt": [f"prompt {i // 4}" for i in range(12)],
            "completion": completions,
            "answer": answers,
            "task": "t",
            "metadata": "{}",
            "completion_tokens": 1,
        }
    )


def test_score_step_rewards_and_group_advantages() -> None:
    rollouts = _synthetic_rollouts()
    fns = build_rewards([{"name": "test_value"}, {"name": "exact_match", "weight": 0.5}])
    scored = score_step(rollouts, fns, group_size=4)
    for col in ("reward", "reward_test_value", "reward_exact_match", "advantage", "kept", "reward_errors",
                "score_seconds"):
        assert col in scored.columns
    values = np.array([float(c) for c in rollouts["completion"]])
    match = np.array([1.0 if c == a else 0.0 for c, a in zip(rollouts["completion"], rollouts["answer"], strict=True)])
    np.testing.assert_allclose(scored["reward_test_value"], values)
    np.testing.assert_allclose(scored["reward_exact_match"], 0.5 * 2.0 * match)  # weight * default reward 2.0
    total = values + match
    np.testing.assert_allclose(scored["reward"], total)
    g = total.reshape(3, 4)
    expected = ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
    expected[4:8] = 0.0  # an all-equal group has no signal
    np.testing.assert_allclose(scored["advantage"], expected, rtol=1e-5, atol=1e-6)
    assert list(scored["kept"]) == [True] * 12
    assert (scored["reward_errors"] == 0).all()
    # the input table is not modified
    assert "reward" not in rollouts.columns

    centred = score_step(rollouts, fns, group_size=4, scale_by_std=False)
    np.testing.assert_allclose(centred["advantage"], (g - g.mean(1, keepdims=True)).reshape(-1), atol=1e-6)

    dyn = score_step(rollouts, fns, group_size=4, dynamic_sampling=True)
    assert list(dyn["kept"]) == [True] * 4 + [False] * 4 + [True] * 4


def test_score_step_metadata_is_optional_and_parsed() -> None:
    rollouts = _synthetic_rollouts()
    fns = build_rewards([{"name": "test_metadata_bonus"}, {"name": "test_value"}])
    rollouts["metadata"] = [json.dumps({"bonus": i % 2}) for i in range(12)]
    scored = score_step(rollouts, fns, group_size=4)
    assert list(scored["reward_test_metadata_bonus"]) == [float(i % 2) for i in range(12)]
    # re-scoring a table that has no metadata column at all (the column is optional)
    scored = score_step(rollouts.drop(columns=["metadata", "task"]), fns, group_size=4)
    assert list(scored["reward_test_metadata_bonus"]) == [0.0] * 12
    assert list(scored["reward"]) == [float(c) for c in rollouts["completion"]]
    # metadata already parsed (an in-memory table) is passed through, not dropped
    rollouts["metadata"] = [{"bonus": 3}] * 12
    assert list(score_step(rollouts, fns, group_size=4)["reward_test_metadata_bonus"]) == [3.0] * 12


def test_score_step_reward_errors() -> None:
    rollouts = _synthetic_rollouts()
    rollouts.loc[5, "completion"] = "not a number"
    fns = build_rewards([{"name": "test_value"}])
    with pytest.raises(Exception, match="test_value"):
        score_step(rollouts, fns, group_size=4)
    scored = score_step(rollouts, fns, group_size=4, on_error="zero")
    assert scored.loc[5, "reward"] == 0.0 and (scored["reward_errors"] == 1).all()


# ------------------------------------------------------------------ update_step


def test_update_step_changes_only_lora_and_reports_metrics(make_policy, prompts_table, many_eos, tmp_path) -> None:
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    state = _state(policy, tmp_path)
    scored = _scored(policy, prompts_table)
    assert scored["completion_tokens"].nunique() > 1  # right-padded completions in the trainer batch
    lora0, base0 = _lora_and_base(policy)
    m = update_step(policy, state, scored, _ucfg(), temperature=1.0)
    lora1, base1 = _lora_and_base(policy)

    assert base0.keys() == base1.keys() and any("weight_packed" in k for k in base0)
    assert all(torch.equal(base0[k], base1[k]) and base0[k].dtype == base1[k].dtype for k in base0)
    changed = [k for k in lora0 if not torch.equal(lora0[k], lora1[k])]
    assert any("lora_A" in k for k in changed) and any("lora_B" in k for k in changed)
    assert not policy.model.training

    assert set(METRIC_KEYS) <= set(m), sorted(set(METRIC_KEYS) - set(m))
    assert m["step"] == 1 and m["skipped_nonfinite"] == 0 and state.bad_steps_in_row == 0
    assert m["sigma"] == 0.0
    rewards = scored["reward"].to_numpy(dtype=float)
    assert math.isclose(m["reward_mean"], rewards.mean(), rel_tol=1e-5)
    assert math.isclose(m["reward_std"], rewards.std(ddof=1), rel_tol=1e-4)
    assert m["completion_len_max"] == scored["completion_tokens"].max()
    assert math.isclose(m["completion_len_mean"], scored["completion_tokens"].mean())
    assert math.isclose(m["truncated_ratio"], scored["truncated"].mean())
    assert 0.0 <= m["zero_std_group_frac"] <= 1.0
    assert m["lr"] == pytest.approx(1e-2)
    assert math.isfinite(m["loss"]) and m["grad_norm"] > 0 and m["entropy"] > 0
    assert 0.0 <= m["clip_ratio_low"] <= 1.0 and 0.0 <= m["clip_ratio_high"] <= 1.0
    assert m["logprob_gap_max"] < 1e-4 and m["logprob_gap_mean"] <= m["logprob_gap_max"]  # no noise: no gap
    assert m["kl_to_base"] > 0  # the randomised adapter moved the policy away from the base
    assert m["t_generate"] > 0 and m["t_score"] >= 0 and m["t_update"] > 0 and m["tokens_per_s"] > 0
    assert m["peak_mem_gib"] > 0
    assert m["groups_kept"] == len(prompts_table)
    assert state.scheduler.last_epoch == 1


def test_update_step_epochs_and_minibatches_step_the_optimizer(make_policy, prompts_table, many_eos, tmp_path) -> None:
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    state = _state(policy, tmp_path, steps_per_step=4)
    scored = _scored(policy, prompts_table)
    update_step(policy, state, scored, _ucfg(epochs=2, minibatches=2), temperature=1.0)
    assert state.scheduler.last_epoch == 4
    assert all(int(s["step"]) == 4 for s in state.optimizer.state.values())


def test_update_step_with_nothing_kept_leaves_weights(make_policy, prompts_table, many_eos, tmp_path, helpers) -> None:
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    state = _state(policy, tmp_path)
    scored = _scored(policy, prompts_table).assign(kept=False)
    before = helpers.snapshot(policy.model)
    m = update_step(policy, state, scored, _ucfg(), temperature=1.0)
    after = helpers.snapshot(policy.model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert m["skipped_nonfinite"] == 0 and m["groups_kept"] == 0 and "loss" not in m


def test_update_step_metrics_with_a_prompt_drawn_twice(make_policy, many_eos, tmp_path) -> None:
    # select_prompts can draw the same prompt twice in one step (a slice across an epoch boundary)
    prompts = pd.DataFrame({"id": ["p0", "p1", "p0"], "prompt": ["1 + 2 =", "a b c", "1 + 2 ="], "answer": "3"})
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    state = _state(policy, tmp_path)
    scored = _scored(policy, prompts)
    assert list(scored["prompt_id"]) == ["p0"] * 4 + ["p1"] * 4 + ["p0"] * 4
    m = update_step(policy, state, scored, _ucfg(), temperature=1.0)
    assert m["groups_kept"] == 3
    groups = scored["reward"].to_numpy(dtype=float).reshape(3, 4)
    assert m["zero_std_group_frac"] == pytest.approx(float((groups.std(1) == 0).mean()))


def test_update_step_bad_late_minibatch_rolls_the_whole_step_back(make_policy, prompts_table, many_eos, tmp_path,
                                                                 helpers) -> None:
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    n = 12
    state = _state(policy, tmp_path, steps_per_step=n)
    scored = _scored(policy, prompts_table)
    cfg = _ucfg(minibatches=n)  # one row per minibatch
    update_step(policy, state, scored, _ucfg(), temperature=1.0)  # a good step first: optimizer state exists
    state.step = 1
    lora = {k: v.clone() for k, v in policy.model.state_dict().items() if "lora_" in k}
    opt = {i: {k: v.clone() for k, v in s.items()} for i, s in state.optimizer.state_dict()["state"].items()}
    epoch, lr = state.scheduler.last_epoch, state.optimizer.param_groups[0]["lr"]

    order = torch.randperm(n, generator=torch.Generator().manual_seed(_mix(cfg.seed, state.step + 1, 3)))
    bad = scored.copy()
    bad.loc[int(order[-1]), "advantage"] = float("nan")  # the last minibatch; 11 good ones run before it
    m = update_step(policy, state, bad, cfg, temperature=1.0)

    assert m["skipped_nonfinite"] == 1 and state.bad_steps_in_row == 1
    assert "loss" not in m and "grad_norm" not in m
    now = {k: v for k, v in policy.model.state_dict().items() if "lora_" in k}
    assert all(helpers.bit_equal(now[k], lora[k]) for k in lora), "a skipped step left partial updates behind"
    assert state.scheduler.last_epoch == epoch and state.optimizer.param_groups[0]["lr"] == lr
    now_opt = state.optimizer.state_dict()["state"]
    assert now_opt.keys() == opt.keys()
    assert all(torch.equal(now_opt[i][k], v) for i, s in opt.items() for k, v in s.items())
    # and the restored optimizer still trains
    m = update_step(policy, state, scored, cfg, temperature=1.0)
    assert m["skipped_nonfinite"] == 0 and state.scheduler.last_epoch == epoch + n


def _nan_advantage(scored: pd.DataFrame) -> pd.DataFrame:
    out = scored.copy()
    out.loc[0, "advantage"] = float("nan")
    return out


def _nan_old_logprobs(scored: pd.DataFrame) -> pd.DataFrame:
    out = scored.copy()
    lp = list(out.loc[0, "logprobs"])
    lp[0] = float("nan")
    out["logprobs"] = [lp] + list(out["logprobs"].iloc[1:])
    return out


@pytest.mark.parametrize("corrupt", [_nan_advantage, _nan_old_logprobs], ids=["nan_advantage", "nan_old_logprobs"])
def test_update_step_skips_nonfinite_and_gives_up_after_max_bad_steps(
    make_policy, prompts_table, many_eos, tmp_path, helpers, corrupt
) -> None:
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    state = _state(policy, tmp_path)
    scored = _scored(policy, prompts_table)
    bad = corrupt(scored)
    cfg = _ucfg(max_bad_steps=2)
    before = helpers.snapshot(policy.model)

    m = update_step(policy, state, bad, cfg, temperature=1.0)
    assert m["skipped_nonfinite"] == 1
    assert (state.bad_steps_in_row, state.bad_steps_total) == (1, 1)
    after = helpers.snapshot(policy.model)
    assert all(helpers.bit_equal(before[k], after[k]) for k in before), "a skipped step changed weights"
    assert state.scheduler.last_epoch == 0 and not state.optimizer.state
    assert all(p.grad is None for p in policy.lora_parameters())
    assert not policy.model.training

    # a good step resets the run of bad steps
    m = update_step(policy, state, scored, cfg, temperature=1.0)
    assert m["skipped_nonfinite"] == 0 and state.bad_steps_in_row == 0 and state.bad_steps_total == 1
    m = update_step(policy, state, bad, cfg, temperature=1.0)
    assert m["skipped_nonfinite"] == 1 and state.bad_steps_in_row == 1

    # the second bad step in a row hits rl.max_bad_steps=2
    with pytest.raises(NonFiniteError, match="max_bad_steps=2"):
        update_step(policy, state, bad, cfg, temperature=1.0)
    assert state.bad_steps_in_row == 2 and state.bad_steps_total == 3
