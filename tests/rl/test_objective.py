"""The RL objective against an independent, naive per-token python implementation."""

from __future__ import annotations

import math

import pytest
import torch

from qerl.errors import QerlConfigError
from qerl.rl.objective import (
    ObjectiveConfig,
    dynamic_sampling_mask,
    group_advantages,
    policy_loss,
    token_logprobs_and_entropy,
    zero_std_group_fraction,
)

# ------------------------------------------------------------------------------------------------
# Naive reference: plain python floats, loops over sequences and tokens.
# ------------------------------------------------------------------------------------------------


def naive_loss(logp, old, adv, mask, cfg, ref=None, ent=None):
    n, t = len(logp), len(logp[0])

    def token_loss(i, j):
        if cfg.loss_type == "pg_entropy":
            value = -logp[i][j] * adv[i]
        else:
            ratio = math.exp(logp[i][j] - old[i][j])
            clipped = min(max(ratio, 1 - cfg.eps_low), 1 + cfg.eps_high)
            value = -min(ratio * adv[i], clipped * adv[i])
        if ref is not None and cfg.beta > 0:
            d = ref[i][j] - logp[i][j]
            value += cfg.beta * (math.exp(d) - d - 1)
        return value

    def agg(f):
        if cfg.loss_type == "grpo":
            per_seq = []
            for i in range(n):
                vals = [f(i, j) for j in range(t) if mask[i][j]]
                per_seq.append(sum(vals) / max(len(vals), 1))
            return sum(per_seq) / n
        total = sum(f(i, j) for i in range(n) for j in range(t) if mask[i][j])
        if cfg.loss_type == "dapo":
            return total / max(sum(sum(row) for row in mask), 1)
        if cfg.loss_type == "dr_grpo":
            return total / (n * cfg.max_completion_length)
        return total / n  # pg_entropy: sum per sequence, mean over sequences

    loss = agg(token_loss)
    if cfg.entropy_coef > 0:
        loss -= cfg.entropy_coef * agg(lambda i, j: ent[i][j])
    return loss


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    n, t = 6, 7
    old = -torch.rand(n, t, generator=g) * 3
    logp = old + 0.4 * torch.randn(n, t, generator=g)  # ratios spread over both clip edges
    ref = old + 0.2 * torch.randn(n, t, generator=g)
    ent = torch.rand(n, t, generator=g) * 2
    adv = torch.randn(n, generator=g)
    lengths = [7, 3, 1, 5, 7, 2]
    mask = torch.tensor([[1 if j < L else 0 for j in range(t)] for L in lengths])
    return logp, old, adv, mask, ref, ent


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "pg_entropy"])
@pytest.mark.parametrize("with_extras", [False, True])
def test_loss_matches_naive(batch, loss_type, with_extras):
    logp, old, adv, mask, ref, ent = batch
    cfg = ObjectiveConfig(loss_type=loss_type, max_completion_length=10,
                          beta=0.05 if with_extras else 0.0,
                          entropy_coef=0.01 if with_extras else 0.0)
    loss, stats = policy_loss(logp.double(), old.double(), adv.double(), mask, cfg,
                              ref_logprobs=ref.double() if with_extras else None,
                              entropy=ent.double() if with_extras else None)
    expected = naive_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), cfg,
                          ref.tolist() if with_extras else None, ent.tolist())
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert all(isinstance(v, float) for v in stats.values())
    assert ("kl" in stats) == with_extras and ("entropy" in stats) == with_extras


def test_padding_garbage_is_ignored(batch):
    logp, old, adv, mask, _, _ = batch
    cfg = ObjectiveConfig(loss_type="dapo")
    clean, _ = policy_loss(logp, old, adv, mask, cfg)
    dirty_old = torch.where(mask.bool(), old, torch.tensor(-float("inf")))
    dirty_logp = torch.where(mask.bool(), logp, torch.tensor(float("nan"))).requires_grad_()
    dirty, _ = policy_loss(dirty_logp, dirty_old, adv, mask, cfg)
    dirty.backward()
    assert dirty.item() == pytest.approx(clean.item())
    assert torch.isfinite(dirty_logp.grad).all()
    assert (dirty_logp.grad[~mask.bool()] == 0).all()


def test_clip_ratio_counts_handcrafted():
    # ratios per token; sequence 0 has A > 0, sequence 1 has A < 0.
    ratios = torch.tensor([[0.5, 1.0, 1.27, 1.29, 2.0],
                           [0.5, 0.79, 0.81, 1.5, 1.0]])
    old = torch.zeros(2, 5)
    logp = torch.log(ratios)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])  # last token of row 1 is padding
    _, stats = policy_loss(logp, old, adv, mask, ObjectiveConfig())
    # high: A>0 and ratio > 1.28 -> 1.29, 2.0 (row 0) = 2 of 9 tokens
    # low: A<0 and ratio < 0.8 -> 0.5, 0.79 (row 1) = 2 of 9 tokens
    assert stats["clip_ratio_high"] == pytest.approx(2 / 9)
    assert stats["clip_ratio_low"] == pytest.approx(2 / 9)
    assert stats["clip_ratio"] == pytest.approx(4 / 9)
    assert stats["ratio_mean"] == pytest.approx((ratios * mask).sum().item() / 9, rel=1e-6)


def test_clipped_tokens_get_no_gradient():
    logp = torch.log(torch.tensor([[2.0, 1.1]])).requires_grad_()
    loss, _ = policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2),
                          ObjectiveConfig(loss_type="dapo"))
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0


def test_kl_stat_k3():
    logp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    _, stats = policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), ObjectiveConfig(),
                           ref_logprobs=ref)
    d = -0.5
    assert stats["kl"] == pytest.approx((math.exp(d) - d - 1) / 2)


def test_group_advantages_exact():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4, eps=0.0)
    std = math.sqrt(1 / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / std, -0.5 / std, -0.5 / std, 0.5 / std, 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected)
    centred = group_advantages(rewards, 4, scale_by_std=False)
    assert centred.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])
    assert group_advantages(torch.tensor([3.0, 5.0]), 1).tolist() == [0.0, 0.0]


def test_dynamic_sampling_and_zero_std_fraction():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.2, 0.2])
    assert dynamic_sampling_mask(rewards, 2).tolist() == [False, False, True, True, False, False]
    assert zero_std_group_fraction(rewards, 2) == pytest.approx(2 / 3)


def test_token_logprobs_and_entropy_matches_reference():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=g)
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    ref = torch.log_softmax(logits.double() / 0.7, -1)
    for chunk in (None, 1, 4):
        logp, ent = token_logprobs_and_entropy(logits, tokens, 0.7, chunk_size=chunk)
        torch.testing.assert_close(logp.double(), ref.gather(-1, tokens[..., None])[..., 0])
        torch.testing.assert_close(ent.double(), -(ref.exp() * ref).sum(-1))


@pytest.mark.parametrize("kwargs, field", [
    ({"loss_type": "ppo"}, "rl.loss_type"),
    ({"eps_low": -0.1}, "rl.eps_low"),
    ({"eps_low": 1.0}, "rl.eps_low"),
    ({"eps_high": float("nan")}, "rl.eps_high"),
    ({"beta": -1.0}, "rl.beta"),
    ({"loss_type": "dr_grpo"}, "rl.max_completion_length"),
])
def test_config_validation(kwargs, field):
    with pytest.raises(QerlConfigError) as err:
        ObjectiveConfig(**kwargs).validate()
    assert err.value.field == field


def test_missing_inputs_raise():
    x = torch.zeros(1, 2)
    with pytest.raises(QerlConfigError, match="rl.beta"):
        policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), ObjectiveConfig(beta=0.1))
    with pytest.raises(QerlConfigError, match="rl.entropy_coef"):
        policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), ObjectiveConfig(entropy_coef=0.1))
    with pytest.raises(QerlConfigError, match="rl.group_size"):
        group_advantages(torch.zeros(5), 2)
