"""The RL objective against an independent, naive per-token python implementation."""

from __future__ import annotations

import math

import pytest
import torch

from qerl.errors import QerlConfigError
from qerl.params import RLParams
from qerl.rl.objective import (
    LossNorm,
    dynamic_sampling_mask,
    group_advantages,
    policy_loss,
    rollout_is_weights,
    token_logprobs_and_entropy,
    zero_std_group_fraction,
)


def ObjectiveConfig(max_completion_length: int | None = None, **kw) -> RLParams:  # noqa: N802 - test shorthand
    cfg = RLParams(**kw)
    object.__setattr__(cfg, "_max_len", max_completion_length)
    return cfg


def norm_of(mask, cfg) -> LossNorm:
    return LossNorm.of(mask.float(), 1, getattr(cfg, "_max_len", None))

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
            return total / (n * cfg._max_len)
        return total / n  # pg_entropy: sum per sequence, mean over sequences

    loss = agg(token_loss)
    if cfg.entropy_coef > 0:  # the entropy bonus is a token mean whatever the loss type (TRL's convention)
        vals = [ent[i][j] for i in range(n) for j in range(t) if mask[i][j]]
        loss -= cfg.entropy_coef * sum(vals) / len(vals)
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
    loss, stats = policy_loss(logp.double(), old.double(), adv.double(), mask, cfg, norm_of(mask, cfg),
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
    # tokens masked with -inf logits carry no mass and add nothing to the entropy (not NaN; the
    # rollout engines' use, without autograd), NaN logits stay NaN
    masked = torch.cat([logits, torch.full((3, 5, 4), float("-inf"))], -1)
    with torch.no_grad():
        logp, ent = token_logprobs_and_entropy(masked, tokens, 0.7)
        nan_ent = token_logprobs_and_entropy(torch.full((1, 1, 3), float("nan")), tokens[:1, :1] % 3)[1]
    assert torch.isnan(nan_ent).all()
    torch.testing.assert_close(ent.double(), -(ref.exp() * ref).sum(-1))
    torch.testing.assert_close(logp.double(), ref.gather(-1, tokens[..., None])[..., 0])


def test_missing_inputs_raise():
    x = torch.zeros(1, 2)
    with pytest.raises(QerlConfigError, match="rl.beta"):
        policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), RLParams(beta=0.1))
    with pytest.raises(QerlConfigError, match="rl.entropy_coef"):
        policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), RLParams(entropy_coef=0.1))
    with pytest.raises(QerlConfigError, match="rl.group_size"):
        group_advantages(torch.zeros(5), 2)


# ------------------------------------------------------------------ rollout importance sampling


def _is_batch():
    g = torch.Generator().manual_seed(3)
    rollout = -torch.rand(4, 5, generator=g) * 2
    old = rollout + torch.tensor([[0.0, 0.1, 1.5, -0.3, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2],
                                  [-1.0, 0.0, 0.0, 0.0, 0.0], [0.5, 0.6, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    return old, rollout, mask


@pytest.mark.parametrize("mode", ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_rollout_is_weights_match_a_hand_computation(mode):
    old, rollout, mask = _is_batch()
    cap = 3.0
    w, stats = rollout_is_weights(old, rollout, mask, mode, cap)
    expected = torch.zeros(4, 5)
    clipped = 0
    for i in range(4):
        seq = math.exp(sum(float(old[i, j] - rollout[i, j]) for j in range(5) if mask[i, j]))
        for j in range(5):
            if not mask[i, j]:
                continue
            rho = seq if mode.startswith("sequence") else math.exp(float(old[i, j] - rollout[i, j]))
            clipped += rho > cap
            expected[i, j] = 1.0 if mode == "none" else min(rho, cap) if mode.endswith("truncate") \
                else (0.0 if rho > cap else rho)
    torch.testing.assert_close(w, expected, atol=1e-5, rtol=1e-5)
    n = int(mask.sum())
    assert stats["mismatch/is_clipped_frac"] == pytest.approx(0.0 if mode == "none" else clipped / n)
    d = (old - rollout)[mask.bool()]
    assert stats["mismatch/kl"] == pytest.approx(float((torch.exp(d) - d - 1).mean()), rel=1e-5)
    assert stats["mismatch/is_weight_max"] >= stats["mismatch/is_weight_mean"] > 0


def test_is_weights_scale_the_policy_gradient_term(batch):
    logp, old, adv, mask, _, _ = batch
    cfg = RLParams(loss_type="dapo")
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)) * 2
    loss, _ = policy_loss(logp, old, adv, mask, cfg, is_weights=w)
    ratio = torch.exp(logp - old)
    per = -torch.minimum(ratio * adv[:, None], torch.clamp(ratio, 0.8, 1.28) * adv[:, None]) * w
    assert loss.item() == pytest.approx(float((per * mask).sum() / mask.sum()), rel=1e-5)


def test_step_denominators_make_accumulation_exact(batch):
    """Summed over micro-batches, the losses with the step's LossNorm equal the one-pass loss (TRL)."""
    logp, old, adv, mask, _, ent = batch
    for loss_type in ("dapo", "grpo", "dr_grpo", "pg_entropy"):
        cfg = RLParams(loss_type=loss_type, entropy_coef=0.01)
        norm = LossNorm.of(mask.float(), 1, 10)
        whole, _ = policy_loss(logp, old, adv, mask, cfg, norm, entropy=ent)
        parts = [policy_loss(logp[s], old[s], adv[s], mask[s], cfg, norm, entropy=ent[s])[0]
                 for s in (slice(0, 2), slice(2, 3), slice(3, 6))]
        assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-5), loss_type
    # two optimizer steps on one generation batch: dapo divides by half the generation batch's tokens
    half = LossNorm.of(mask.float(), 2)
    assert half.tokens == pytest.approx(float(mask.sum()) / 2)
    first, _ = policy_loss(logp[:3], old[:3], adv[:3], mask[:3], RLParams(), half)
    ratio = torch.exp(logp[:3] - old[:3])
    per = -torch.minimum(ratio * adv[:3, None], torch.clamp(ratio, 0.8, 1.28) * adv[:3, None])
    assert float(first) == pytest.approx(float((per * mask[:3]).sum()) / (float(mask.sum()) / 2), rel=1e-5)


def _trl_loss(logp, old, adv, mask, is_ratio, loss_type="dapo", eps_low=0.2, eps_high=0.28, entropy_coef=0.0, ent=None):
    """TRL 1.16's GRPOTrainer._compute_loss on these tensors (one process, no accumulation)."""
    from types import SimpleNamespace

    trl = pytest.importorskip("trl.trainer.grpo_trainer")

    class _Acc:
        num_processes = 1
        sync_gradients = True

        def gather(self, x):
            return x

        def gather_for_metrics(self, x):
            return x

        def reduce(self, x, reduction="sum"):
            return x

    self = SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=0.0,
        loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high, args=SimpleNamespace(delta=None, steps_per_generation=1),
        use_vllm=True, vllm_importance_sampling_correction=True, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=_Acc(), _entropy_bonus_enabled=entropy_coef != 0,
        use_adaptive_entropy=False, entropy_coef=entropy_coef, aux_loss_enabled=False, max_completion_length=mask.shape[1],
        _metrics={"train": __import__("collections").defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, ent if ent is not None else torch.zeros_like(logp), None),
    )
    n, t = mask.shape
    inputs = {"prompt_ids": torch.zeros(n, 1, dtype=torch.long), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
              "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": mask.long(), "advantages": adv,
              "old_per_token_logps": old, "num_items_in_batch": mask.sum().float(), "importance_sampling_ratio": is_ratio}
    return trl.GRPOTrainer._compute_loss(self, None, inputs)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_loss_equals_trl_compute_loss(batch, mode, loss_type):
    logp, old, adv, mask, _, ent = batch
    rollout = old - 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(7))
    w, _ = rollout_is_weights(old, rollout, mask, mode, 3.0)
    cfg = RLParams(loss_type=loss_type, entropy_coef=0.01)
    ours, _ = policy_loss(logp.double(), old.double(), adv.double(), mask, cfg, is_weights=w.double(), entropy=ent.double())
    trl_w = w if mode.startswith("token") else w[:, :1]  # TRL keeps one sequence weight per row: (B, 1)
    theirs = _trl_loss(logp.double(), old.double(), adv.double(), mask, trl_w.double(), loss_type=loss_type,
                       entropy_coef=0.01, ent=ent.double())
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6, abs=1e-9)  # ours computes in float32


def test_missing_inputs_and_bad_mode_raise():
    x = torch.zeros(1, 2)
    with pytest.raises(QerlConfigError, match="rl.rollout_is"):
        rollout_is_weights(x, x, torch.ones(1, 2), "token_clip", 3.0)
