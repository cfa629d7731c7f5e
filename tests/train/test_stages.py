"""The RL step's stages (rollout generation, reward scoring, the LoRA update) and the prompt helpers,
on tiny CPU policies.

Central property: the log-probs the rollout engine records are the ones the trainer computes
(``make_batch`` + ``completion_logprobs``): without AQN noise the rollout/trainer gap is ~0, for a
plain and a 4-bit (nvfp4) base with a non-zero LoRA adapter, prompts of different lengths in one batch.
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
from qerl.noise.schedules import NoNoise
from qerl.params import RewardParams, RLParams, RolloutParams
from qerl.rewards.base import register_reward
from qerl.rollout.base import SamplingParams
from qerl.rollout.hf import HFGenerateEngine
from qerl.train.checkpoints import RunDir
from qerl.train.generate import encode_prompts, rollout_step, sample_rollouts, select_prompts
from qerl.train.score import score_step
from qerl.train.seeds import generator
from qerl.train.state import TrainState, build_optimizer, build_scheduler
from qerl.train.update import (
    NonFiniteError,
    completion_logprobs,
    make_batch,
    micro_batches,
    update_step,
)

PROMPT_IDS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [3]]

ROLLOUT_COLUMNS = [
    "step", "prompt_id", "sample", "prompt", "completion", "prompt_ids", "completion_ids", "logprobs",
    "prompt_tokens", "completion_tokens", "truncated", "sum_logprob", "mean_entropy", "sigma", "answer",
    "task", "metadata", "generate_seconds", "prompts_truncated", "prompts_dropped",
]

METRIC_KEYS = [
    "step", "reward/mean", "reward/std", "reward/zero_std_group_frac", "rollout/completion_len_mean",
    "rollout/completion_len_max", "rollout/truncated_ratio", "rollout/entropy", "train/entropy",
    "train/clip_ratio_low", "train/clip_ratio_high", "train/loss", "train/grad_norm", "train/lr", "noise/sigma",
    "mismatch/logprob_gap_mean", "mismatch/logprob_gap_max", "mismatch/kl", "mismatch/is_weight_mean",
    "mismatch/is_weight_max", "mismatch/is_clipped_frac", "train/kl_to_base", "time/generate", "time/score",
    "time/update", "rollout/tokens_per_s", "memory/peak_gib", "memory/alloc_retries",
]


def _value_reward(scale: float = 1.0):
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
    logits = logits[len(prompt) - 1: len(prompt) - 1 + len(completion)]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


def _rcfg(**kw) -> RolloutParams:
    return RolloutParams(**{"group_size": 4, "temperature": 1.0, "max_new_tokens": 6, "max_prompt_tokens": 32, **kw})


def _rl(**kw) -> RLParams:
    return RLParams(**{"loss_type": "dapo", "max_grad_norm": 1.0, "max_bad_steps": 3, "seed": 0, **kw})


def _rewards(*names: str, **weights: float) -> RewardParams:
    return RewardParams(functions=[{"name": n, "weight": weights.get(n, 1.0)} for n in names])


def _trainer_logprobs(policy, table: pd.DataFrame, temperature: float):
    batch = make_batch(list(table["prompt_ids"]), list(table["completion_ids"]), policy.pad_token_id, policy.device)
    with torch.no_grad():
        logp, _ = completion_logprobs(policy.model, batch, temperature)
    old = torch.zeros_like(logp)
    for i, lp in enumerate(table["logprobs"]):
        old[i, : len(lp)] = torch.tensor(list(lp))
    return logp, old, batch["mask"]


def _state(policy, tmp_path, lr: float = 1e-2, steps_per_step: int = 1) -> TrainState:
    opt = build_optimizer(policy.lora_parameters(), "adamw", lr, 0.0)
    return TrainState(run=RunDir(tmp_path, "t", "fp"), total_steps=10, save_every=100, optimizer=opt,
                      scheduler=build_scheduler(opt, 10 * steps_per_step, 0.0, "constant"), noise=NoNoise())


def _scored(policy, prompts: pd.DataFrame, step: int = 1, sigma: float = 0.0, group: int = 4) -> pd.DataFrame:
    """Real rollouts + real scoring; advantages then set to fixed +-1 so every group carries signal."""
    rollouts = rollout_step(policy, prompts, step, sigma, _rcfg(group_size=group), 0, HFGenerateEngine())
    scored = score_step(rollouts, _rewards("test_text_len"), _rl())
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
    for first in (1, 3):
        ids = [i for s in (first, first + 1) for i in select_prompts(table, s, 5, seed=7)["id"]]
        assert sorted(ids) == sorted(table["id"]), ids
    ids = [i for s in range(1, 6) for i in select_prompts(table, s, 4, seed=3)["id"]]
    assert sorted(ids[:10]) == sorted(table["id"]) and sorted(ids[10:]) == sorted(table["id"])
    epoch0 = lambda seed: [i for s in (1, 2) for i in select_prompts(table, s, 5, seed)["id"]]  # noqa: E731
    assert epoch0(0) != epoch0(1) and epoch0(0) == epoch0(0)
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
    ids, kept, n_trunc, n_drop = encode_prompts(policy, texts, max_tokens=4, overlong="drop")
    assert kept == [1] and ids == [full[1]] and (n_trunc, n_drop) == (0, 2)
    long_only = prompts_table.assign(prompt=["a b c d e f g h", "1 2 3 4 5 6", "x y z w v"])
    with pytest.raises(ValueError, match=r"rollout\.max_prompt_tokens"):
        rollout_step(policy, long_only, 1, 0.0, _rcfg(max_prompt_tokens=3, overlong_prompt="drop"), 0, HFGenerateEngine())


def test_rollout_step_counts_and_logs_truncated_and_dropped_prompts(make_policy, prompts_table, caplog) -> None:
    policy = make_policy("nvfp4")
    with caplog.at_level("WARNING", logger="qerl.train.generate"):
        table = rollout_step(policy, prompts_table, 1, 0.0, _rcfg(max_prompt_tokens=4, group_size=2), 0, HFGenerateEngine())
    assert "1 prompt(s) longer than rollout.max_prompt_tokens=4 were truncated" in caplog.text
    assert (table["prompts_truncated"] == 1).all() and (table["prompts_dropped"] == 0).all()
    long_rows = table[table["prompt_id"] == "p1"]
    assert all(p == policy.tokenizer("a b c d e f ?")["input_ids"][-4:] for p in long_rows["prompt_ids"])
    table = rollout_step(policy, prompts_table, 1, 0.0, _rcfg(max_prompt_tokens=4, group_size=2, overlong_prompt="drop"),
                         0, HFGenerateEngine())
    assert list(table["prompt_id"]) == ["p0", "p0", "p2", "p2"]
    assert (table["prompts_dropped"] == 1).all() and (table["prompts_truncated"] == 0).all()


# ------------------------------------------------------------------ the HF engine


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.3, 0.8)])
def test_hf_engine_shapes_eos_mask_and_logprobs(make_policy, temperature: float, top_p: float) -> None:
    policy = make_policy("nvfp4", lora_seed=1)
    model = policy.model
    eos = tuple(range(20, 28))
    n, max_new = 3, 8
    sp = SamplingParams(n=n, temperature=temperature, top_p=top_p, max_new_tokens=max_new, eos_token_ids=eos, pad_token_id=0)
    model.train()
    batch = HFGenerateEngine().generate(model, PROMPT_IDS, sp, torch.Generator().manual_seed(0))
    assert model.training
    model.eval()
    N, T = len(PROMPT_IDS) * n, batch.completion_ids.shape[1]
    assert len(batch) == N and T == max_new
    for t in (batch.completion_ids, batch.completion_mask, batch.logprobs, batch.extras["entropy"]):
        assert tuple(t.shape) == (N, T)
    assert batch.prompt_index.tolist() == [i for i in range(len(PROMPT_IDS)) for _ in range(n)]
    assert 0 < int(batch.truncated.sum()) < N
    for i in range(N):
        toks, mask = batch.completion_ids[i].tolist(), batch.completion_mask[i].tolist()
        hits = [j for j, t in enumerate(toks) if t in eos]
        length = T if batch.truncated[i] else hits[0] + 1
        assert mask == [1.0] * length + [0.0] * (T - length)
        assert int(batch.completion_lengths[i]) == length
        ref = _recomputed_logprobs(model, batch.prompt_ids[i], toks[:length], temperature)
        torch.testing.assert_close(batch.logprobs[i, :length], ref, atol=1e-4, rtol=0)
    again = HFGenerateEngine().generate(model, PROMPT_IDS, sp, torch.Generator().manual_seed(0))
    assert torch.equal(again.completion_ids, batch.completion_ids)
    other = HFGenerateEngine().generate(model, PROMPT_IDS, sp, torch.Generator().manual_seed(1))
    assert not torch.equal(other.completion_ids[:, :3], batch.completion_ids[:, :3])


@pytest.mark.parametrize("fmt", ["none", "nvfp4"])
def test_hf_engine_greedy_equals_plain_generate(make_policy, fmt: str) -> None:
    policy = make_policy(fmt, lora_seed=2)
    model = policy.model
    sp = SamplingParams(n=2, max_new_tokens=10, eos_token_ids=(1,), pad_token_id=0, greedy=True)
    batch = HFGenerateEngine().generate(model, PROMPT_IDS, sp)
    for i, prompt in enumerate(PROMPT_IDS):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=10, eos_token_id=[1], pad_token_id=0)
        expected = out[0, len(prompt):].tolist()
        if 1 in expected:
            expected = expected[: expected.index(1) + 1]
        for row in (2 * i, 2 * i + 1):
            k = int(batch.completion_lengths[row])
            assert batch.completion_ids[row, :k].tolist() == expected


# ------------------------------------------------------------------ rollout_step


@pytest.mark.parametrize("fmt", ["none", "nvfp4"])
def test_rollout_logprobs_equal_trainer_logprobs_without_noise(make_policy, prompts_table, many_eos, fmt: str) -> None:
    policy = make_policy(fmt, lora_seed=3, eos=many_eos)
    table = rollout_step(policy, prompts_table, 2, 0.0, _rcfg(temperature=0.9), 5, HFGenerateEngine())
    assert table["prompt_tokens"].nunique() == 3 and table["completion_tokens"].nunique() > 1
    logp, old, mask = _trainer_logprobs(policy, table, 0.9)
    m = mask.bool()
    assert int(m.sum()) == int(table["completion_tokens"].sum())
    assert float((logp - old).abs()[m].max()) < 1e-4
    for _, row in table.iterrows():
        ref = _recomputed_logprobs(policy.model, list(row["prompt_ids"]), list(row["completion_ids"]), 0.9)
        torch.testing.assert_close(torch.tensor(list(row["logprobs"]), dtype=torch.float32), ref, atol=1e-4, rtol=0)


def test_completion_logprobs_chunks_and_checkpointing_do_not_change_values_or_grads(make_policy, prompts_table) -> None:
    policy = make_policy("nvfp4", lora_seed=3)
    table = rollout_step(policy, prompts_table, 1, 0.0, _rcfg(), 0, HFGenerateEngine())
    batch = make_batch(list(table["prompt_ids"]), list(table["completion_ids"]), policy.pad_token_id, policy.device)
    grads = []
    for chunk in (1, 5, 10_000):
        policy.model.zero_grad(set_to_none=True)
        logp, ent = completion_logprobs(policy.model, batch, 1.0, chunk_tokens=chunk)
        ((logp * batch["mask"]).sum() + 0.1 * (ent * batch["mask"]).sum()).backward()
        grads.append([p.grad.clone() for p in policy.lora_parameters()])
        if chunk == 1:
            ref = (logp.detach(), ent.detach())
        else:
            torch.testing.assert_close(logp.detach(), ref[0], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(ent.detach(), ref[1], atol=1e-6, rtol=1e-6)
    for g in grads[1:]:
        for a, b in zip(grads[0], g, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert (ent.detach()[batch["mask"].bool()] > 0).all() and (logp.detach()[~batch["mask"].bool()] == 0).all()


def test_rollout_step_table(make_policy, prompts_table, many_eos) -> None:
    policy = make_policy("nvfp4", lora_seed=0, eos=many_eos)
    G = 4
    table = rollout_step(policy, prompts_table, 3, 0.0, _rcfg(group_size=G), 0, HFGenerateEngine())
    assert set(ROLLOUT_COLUMNS) <= set(table.columns)
    assert len(table) == len(prompts_table) * G
    assert (table["step"] == 3).all() and (table["sigma"] == 0.0).all()
    assert list(table["prompt_id"]) == [p for p in prompts_table["id"] for _ in range(G)]
    assert list(table["sample"]) == list(range(G)) * len(prompts_table)
    assert [json.loads(m)["k"] for m in table["metadata"]] == [k for k in range(3) for _ in range(G)]
    for _, row in table.iterrows():
        assert list(row["prompt_ids"]) == policy.tokenizer(row["prompt"])["input_ids"]
        assert row["completion_tokens"] == len(row["completion_ids"]) == len(row["logprobs"]) >= 1
        ends = [t in many_eos for t in row["completion_ids"]]
        assert row["truncated"] == (not any(ends))
        assert math.isclose(row["sum_logprob"], float(sum(row["logprobs"])), rel_tol=1e-6, abs_tol=1e-6)
        assert row["mean_entropy"] > 0
        assert "<eos>" not in row["completion"] and "<pad>" not in row["completion"]
    again = rollout_step(policy, prompts_table, 3, 0.0, _rcfg(group_size=G), 0, HFGenerateEngine())
    assert list(again["completion_ids"].map(list)) == list(table["completion_ids"].map(list))
    other = rollout_step(policy, prompts_table, 4, 0.0, _rcfg(group_size=G), 0, HFGenerateEngine())
    assert list(other["completion_ids"].map(list)) != list(table["completion_ids"].map(list))
    buf = io.BytesIO()
    table.to_parquet(buf, index=False)
    back = pd.read_parquet(io.BytesIO(buf.getvalue()))
    assert [list(x) for x in back["completion_ids"]] == [list(x) for x in table["completion_ids"]]


def test_rollout_step_noise_reaches_rollouts_and_weights_come_back(make_policy, prompts_table, helpers) -> None:
    policy = make_policy("nvfp4", lora_seed=0)
    before = helpers.snapshot(policy.model)
    clean = rollout_step(policy, prompts_table, 1, 0.0, _rcfg(), 0, HFGenerateEngine())
    noisy = rollout_step(policy, prompts_table, 1, 0.05, _rcfg(), 0, HFGenerateEngine())
    assert (noisy["sigma"] == 0.05).all() and (noisy["noise_changed_fraction"] > 0.9).all()
    same_first = [(c[0], n[0]) for c, n, a, b in zip(clean["logprobs"], noisy["logprobs"], clean["completion_ids"],
                                                        noisy["completion_ids"], strict=True) if a[0] == b[0]]
    assert same_first and all(abs(c - n) > 1e-6 for c, n in same_first)
    logp, old, mask = _trainer_logprobs(policy, noisy, 1.0)
    assert float((logp - old).abs()[mask.bool()].max()) > 1e-4
    after = helpers.snapshot(policy.model)
    assert all(helpers.bit_equal(before[k], after[k]) for k in before)
    assert find_aqn_targets(policy.model)
    noisy2 = rollout_step(policy, prompts_table, 1, 0.05, _rcfg(), 0, HFGenerateEngine())
    assert [list(x) for x in noisy2["logprobs"]] == [list(x) for x in noisy["logprobs"]]


# ------------------------------------------------------------------ score_step


def _synthetic_rollouts() -> pd.DataFrame:
    completions = ["1", "2", "3", "4", "5", "5", "5", "5", "0", "0", "7", "0"]
    return pd.DataFrame({
        "step": 1, "prompt_id": [f"g{i // 4}" for i in range(12)], "sample": [i % 4 for i in range(12)],
        "prompt": [f"prompt {i // 4}" for i in range(12)], "completion": completions,
        "answer": ["3"] * 4 + ["0"] * 4 + ["7"] * 4, "task": "t", "metadata": "{}", "completion_tokens": 1,
    })


def test_score_step_rewards_and_group_advantages() -> None:
    rollouts = _synthetic_rollouts()
    fns = _rewards("test_value", "exact_match", exact_match=0.5)
    scored = score_step(rollouts, fns, _rl())
    values = np.array([float(c) for c in rollouts["completion"]])
    match = np.array([1.0 if c == a else 0.0 for c, a in zip(rollouts["completion"], rollouts["answer"], strict=True)])
    np.testing.assert_allclose(scored["reward_test_value"], values)
    np.testing.assert_allclose(scored["reward_exact_match"], 0.5 * 2.0 * match)
    total = values + match
    np.testing.assert_allclose(scored["reward"], total)
    g = total.reshape(3, 4)
    expected = ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)
    expected[4:8] = 0.0
    np.testing.assert_allclose(scored["advantage"], expected, rtol=1e-5, atol=1e-6)
    assert list(scored["kept"]) == [True] * 12 and "reward" not in rollouts.columns
    centred = score_step(rollouts, fns, _rl(scale_by_std=False))
    np.testing.assert_allclose(centred["advantage"], (g - g.mean(1, keepdims=True)).reshape(-1), atol=1e-6)
    dyn = score_step(rollouts, fns, _rl(dynamic_sampling=True))
    assert list(dyn["kept"]) == [True] * 4 + [False] * 4 + [True] * 4


def test_score_step_metadata_is_optional_and_parsed() -> None:
    rollouts = _synthetic_rollouts()
    fns = _rewards("test_metadata_bonus", "test_value")
    rollouts["metadata"] = [json.dumps({"bonus": i % 2}) for i in range(12)]
    assert list(score_step(rollouts, fns, _rl())["reward_test_metadata_bonus"]) == [float(i % 2) for i in range(12)]
    scored = score_step(rollouts.drop(columns=["metadata", "task"]), fns, _rl())
    assert list(scored["reward_test_metadata_bonus"]) == [0.0] * 12
    rollouts["metadata"] = [{"bonus": 3}] * 12
    assert list(score_step(rollouts, fns, _rl())["reward_test_metadata_bonus"]) == [3.0] * 12


def test_score_step_reward_errors() -> None:
    rollouts = _synthetic_rollouts()
    rollouts.loc[5, "completion"] = "not a number"
    with pytest.raises(Exception, match="test_value"):
        score_step(rollouts, _rewards("test_value"), _rl())
    zero = RewardParams(functions=[{"name": "test_value"}], on_error="zero")
    scored = score_step(rollouts, zero, _rl())
    assert scored.loc[5, "reward"] == 0.0 and (scored["reward_errors"] == 1).all()


# ------------------------------------------------------------------ update_step


def test_update_step_changes_only_lora_and_reports_metrics(make_policy, prompts_table, many_eos, tmp_path) -> None:
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    state = _state(policy, tmp_path)
    scored = _scored(policy, prompts_table)
    assert scored["completion_tokens"].nunique() > 1
    lora0, base0 = _lora_and_base(policy)
    m = update_step(policy, state, scored, _rl(), _rcfg())
    lora1, base1 = _lora_and_base(policy)
    assert any("weight_packed" in k for k in base0)
    assert all(torch.equal(base0[k], base1[k]) and base0[k].dtype == base1[k].dtype for k in base0)
    changed = [k for k in lora0 if not torch.equal(lora0[k], lora1[k])]
    assert any("lora_A" in k for k in changed) and any("lora_B" in k for k in changed)
    assert not policy.model.training
    assert set(METRIC_KEYS) <= set(m), sorted(set(METRIC_KEYS) - set(m))
    assert m["step"] == 1 and m["train/skipped_nonfinite"] == 0 and m["noise/sigma"] == 0.0
    rewards = scored["reward"].to_numpy(dtype=float)
    assert math.isclose(m["reward/mean"], rewards.mean(), rel_tol=1e-5)
    assert math.isclose(m["reward/std"], rewards.std(ddof=1), rel_tol=1e-4)
    assert m["rollout/completion_len_max"] == scored["completion_tokens"].max()
    assert m["train/lr"] == pytest.approx(1e-2)
    assert math.isfinite(m["train/loss"]) and m["train/grad_norm"] > 0 and m["train/entropy"] > 0
    # no noise and the same forward: recomputed old log-probs = rollout log-probs, IS weights = 1
    assert m["mismatch/logprob_gap_max"] < 1e-4 and m["mismatch/is_clipped_frac"] == 0.0
    assert m["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-4) and m["mismatch/kl"] < 1e-8
    assert m["train/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # ratio exactly 1 on the first epoch
    # the rollout entropy is the sampler's, recorded apart from the trainer's token entropy
    assert m["rollout/entropy"] == pytest.approx(float(np.nanmean(scored["mean_entropy"])))
    assert m["train/kl_to_base"] > 0
    assert m["time/update"] > 0 and m["memory/peak_gib"] > 0 and m["reward/groups_kept"] == len(prompts_table)
    assert state.scheduler.last_epoch == 1


def test_update_step_epochs_and_minibatches_step_the_optimizer(make_policy, prompts_table, many_eos, tmp_path) -> None:
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    state = _state(policy, tmp_path, steps_per_step=4)
    update_step(policy, state, _scored(policy, prompts_table), _rl(epochs=2, minibatches=2), _rcfg())
    assert state.scheduler.last_epoch == 4
    assert all(int(s["step"]) == 4 for s in state.optimizer.state.values())


def test_micro_batches_cap_padded_tokens_and_sort_by_length() -> None:
    lengths = [5, 9, 2, 7, 7, 3]
    mbs = micro_batches(list(range(6)), lengths, max_tokens=14)
    assert sorted(i for mb in mbs for i in mb) == list(range(6))
    for mb in mbs:
        assert len(mb) * max(lengths[i] for i in mb) <= 14 or len(mb) == 1
        assert [lengths[i] for i in mb] == sorted((lengths[i] for i in mb), reverse=True)
    assert micro_batches([0, 1], lengths, None) == [[1, 0]]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_gradient_accumulation_equals_one_pass_over_the_union(make_policy, prompts_table, many_eos, tmp_path,
                                                             loss_type: str) -> None:
    """An optimizer step over k micro-batches applies the gradient of one pass over their union."""
    updates = []
    for budget in (None, 12):
        policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
        state = _state(policy, tmp_path)
        scored = _scored(policy, prompts_table)
        lora0, _ = _lora_and_base(policy)
        # plain SGD with lr 1 and no clipping: the update is the gradient
        state.optimizer = torch.optim.SGD(policy.lora_parameters(), lr=1.0)
        state.scheduler = build_scheduler(state.optimizer, 10, 0.0, "constant")
        m = update_step(policy, state, scored, _rl(loss_type=loss_type, micro_batch_tokens=budget, max_grad_norm=1e9),
                        _rcfg())
        lora1, _ = _lora_and_base(policy)
        updates.append(({k: lora1[k] - lora0[k] for k in lora0}, m["train/micro_batches"]))
    (whole, n1), (accum, n2) = updates
    assert n1 == 1 and n2 > 2
    for k in whole:
        torch.testing.assert_close(accum[k], whole[k], atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("minibatches", [1, 2])
def test_fused_old_logprobs_equal_a_separate_recompute(make_policy, prompts_table, many_eos, tmp_path,
                                                       monkeypatch, minibatches: int) -> None:
    """The first optimizer step takes its rows' PPO denominators from its own forward: the same update
    and the same mismatch metrics as a no-grad recompute pass over every row before it (with noisy
    rollouts, so the importance weights are not all 1); the pass covers only the later minibatches'
    rows (none with one optimizer step)."""
    import qerl.train.update as upd

    runs, real = [], upd.recompute_logprobs
    for fused in (True, False):
        policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
        state = _state(policy, tmp_path)
        scored = _scored(policy, prompts_table, sigma=0.05)
        lora0, _ = _lora_and_base(policy)
        recomputed = []

        def counted(policy_, rows, *a, only=None, recomputed=recomputed, **k):
            recomputed.append(len(rows) if only is None else len(only))
            return real(policy_, rows, *a, only=only, **k)

        monkeypatch.setattr(upd, "fused_old_logprobs", lambda rl, f=fused: f and rl.old_logprobs == "recompute")
        monkeypatch.setattr(upd, "recompute_logprobs", counted)
        m = update_step(policy, state, scored, _rl(micro_batch_tokens=12, minibatches=minibatches), _rcfg())
        lora1, _ = _lora_and_base(policy)
        runs.append(({k: lora1[k] - lora0[k] for k in lora0}, m, recomputed, int(scored["kept"].sum())))
    (d_fused, m_fused, n_fused, kept), (d_ref, m_ref, n_ref, _) = runs
    assert n_ref == [kept]
    assert n_fused == ([] if minibatches == 1 else [kept - math.ceil(kept / minibatches)])
    assert m_ref["mismatch/logprob_gap_max"] > 1e-3 and m_ref["mismatch/is_weight_max"] != 1.0
    assert m_fused["train/optimizer_steps"] == minibatches
    for key in ("mismatch/logprob_gap_mean", "mismatch/logprob_gap_max", "mismatch/kl",
                "mismatch/is_weight_mean", "mismatch/is_weight_max", "mismatch/is_clipped_frac", "train/loss"):
        assert m_fused[key] == pytest.approx(m_ref[key], rel=1e-4, abs=1e-6), key
    for k in d_ref:
        torch.testing.assert_close(d_fused[k], d_ref[k], atol=2e-6, rtol=1e-4)


def test_update_step_with_nothing_kept_leaves_weights(make_policy, prompts_table, many_eos, tmp_path, helpers) -> None:
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    state = _state(policy, tmp_path)
    scored = _scored(policy, prompts_table).assign(kept=False)
    before = helpers.snapshot(policy.model)
    m = update_step(policy, state, scored, _rl(), _rcfg())
    assert all(torch.equal(before[k], v) for k, v in helpers.snapshot(policy.model).items())
    assert m["train/skipped_nonfinite"] == 0 and m["reward/groups_kept"] == 0 and "train/loss" not in m


def test_update_step_bad_late_minibatch_rolls_the_whole_step_back(make_policy, prompts_table, many_eos, tmp_path,
                                                                 helpers) -> None:
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    n = 12
    state = _state(policy, tmp_path, steps_per_step=n)
    scored = _scored(policy, prompts_table)
    cfg = _rl(minibatches=n)
    update_step(policy, state, scored, _rl(), _rcfg())
    lora = {k: v.clone() for k, v in policy.model.state_dict().items() if "lora_" in k}
    opt = {i: {k: v.clone() for k, v in s.items()} for i, s in state.optimizer.state_dict()["state"].items()}
    epoch, lr = state.scheduler.last_epoch, state.optimizer.param_groups[0]["lr"]
    order = torch.randperm(n, generator=generator(cfg.seed, 1, "minibatch"))
    bad = scored.copy()
    bad.loc[int(order[-1]), "advantage"] = float("nan")  # the last minibatch; 11 good ones run before it
    m = update_step(policy, state, bad, cfg, _rcfg())
    assert m["train/skipped_nonfinite"] == 1 and state.bad_steps_in_row == 1 and "train/loss" not in m
    now = {k: v for k, v in policy.model.state_dict().items() if "lora_" in k}
    assert all(helpers.bit_equal(now[k], lora[k]) for k in lora), "a skipped step left partial updates behind"
    assert state.scheduler.last_epoch == epoch and state.optimizer.param_groups[0]["lr"] == lr
    now_opt = state.optimizer.state_dict()["state"]
    assert all(torch.equal(now_opt[i][k], v) for i, s in opt.items() for k, v in s.items())
    m = update_step(policy, state, scored, cfg, _rcfg())
    assert m["train/skipped_nonfinite"] == 0 and state.scheduler.last_epoch == epoch + n


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


@pytest.mark.parametrize("corrupt", [_nan_advantage, _nan_old_logprobs], ids=["nan_advantage", "nan_rollout_logprobs"])
def test_update_step_skips_nonfinite_and_gives_up_after_max_bad_steps(make_policy, prompts_table, many_eos, tmp_path,
                                                                     helpers, corrupt) -> None:
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    state = _state(policy, tmp_path)
    scored = _scored(policy, prompts_table)
    bad = corrupt(scored)
    cfg = _rl(max_bad_steps=2, old_logprobs="rollout", rollout_is="none")  # the rollout log-probs enter the ratio
    before = helpers.snapshot(policy.model)
    m = update_step(policy, state, bad, cfg, _rcfg())
    assert m["train/skipped_nonfinite"] == 1 and (state.bad_steps_in_row, state.bad_steps_total) == (1, 1)
    assert all(helpers.bit_equal(before[k], v) for k, v in helpers.snapshot(policy.model).items())
    assert state.scheduler.last_epoch == 0 and not state.optimizer.state
    assert all(p.grad is None for p in policy.lora_parameters()) and not policy.model.training
    m = update_step(policy, state, scored, cfg, _rcfg())
    assert m["train/skipped_nonfinite"] == 0 and state.bad_steps_in_row == 0 and state.bad_steps_total == 1
    m = update_step(policy, state, bad, cfg, _rcfg())
    assert m["train/skipped_nonfinite"] == 1 and state.bad_steps_in_row == 1
    with pytest.raises(NonFiniteError, match="max_bad_steps=2"):
        update_step(policy, state, bad, cfg, _rcfg())
    assert state.bad_steps_in_row == 2 and state.bad_steps_total == 3


def test_recompute_makes_nan_rollout_logprobs_harmless(make_policy, prompts_table, many_eos, tmp_path) -> None:
    """With recomputed old log-probs, a NaN in the rollout's record only neutralises that token's IS weight."""
    policy = make_policy("nvfp4", lora_seed=4, eos=many_eos)
    state = _state(policy, tmp_path)
    m = update_step(policy, state, _nan_old_logprobs(_scored(policy, prompts_table)), _rl(), _rcfg())
    assert m["train/skipped_nonfinite"] == 0 and math.isfinite(m["train/loss"])


def test_alloc_retries_read_the_cuda_allocator_and_are_zero_on_cpu(monkeypatch) -> None:
    from qerl.train.metrics import alloc_retries

    assert alloc_retries(torch.device("cpu")) == 0
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 3})
    assert alloc_retries(torch.device("cuda", 0)) == 3
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})  # no allocation yet
    assert alloc_retries(torch.device("cuda", 0)) == 0


def test_console_line_shows_the_step_time_split_and_skips_missing_values() -> None:
    from qerl.train.metrics import console_line

    row = {"step": 3, "reward/mean": 0.5, "time/generate": 12.34, "time/update": 56.78,
           "memory/peak_gib": float("nan"), "train/loss": -0.25}
    line = console_line(row, 10, eta_s=90)
    assert line.startswith("step    3/10 | reward 0.500")
    assert "gen 12.3s" in line and "update 56.8s" in line and "loss -0.2500" in line
    assert "peak" not in line  # NaN (no CUDA) is left out
    assert line.endswith("eta 1m30s")


def test_sample_rollouts_is_rollout_steps_sampling_and_can_drop_eos(make_policy, prompts_table, many_eos) -> None:
    """``rollout_step`` = encode + ``sample_rollouts``: the same table from the same ids and draws;
    ``eos_token_ids=()`` makes every completion run to ``max_new_tokens`` (the benchmarks' fixed length)."""
    policy = make_policy(eos=many_eos)  # many EOS ids: the tiny model stops early now and then
    cfg = _rcfg(group_size=3, max_new_tokens=8)
    via_step = rollout_step(policy, prompts_table, 2, 0.0, cfg, 7, HFGenerateEngine())
    ids, kept, _, _ = encode_prompts(policy, list(prompts_table["prompt"]), cfg.max_prompt_tokens, "truncate")
    direct = sample_rollouts(policy, prompts_table, ids, 2, 0.0, cfg, 7, HFGenerateEngine(), rows=kept)
    assert list(direct["completion_ids"]) == list(via_step["completion_ids"])
    assert (via_step["completion_tokens"] < 8).any()  # some stopped at an EOS
    fixed = sample_rollouts(policy, prompts_table, ids, 2, 0.0, cfg, 7, HFGenerateEngine(), eos_token_ids=())
    assert (fixed["completion_tokens"] == 8).all() and len(fixed) == 3 * len(prompts_table)
