"""The RL objective: group advantages, the clipped policy loss and its aggregations.

Reads top to bottom in the order a trainer uses it:

1. ``token_logprobs_and_entropy`` (:mod:`qerl.rl.logprobs`) -- per-token log-probs (and entropies) of the sampled tokens under
   the current policy, ``log_softmax(logits / temperature)[token]`` (the rollout convention of
   ``qerl.rollout.base``, so rollout and trainer log-probs are comparable).
2. ``group_advantages`` -- GRPO's group-normalised advantage (eq. "A_i = (r_i - mean(r)) / std(r)"),
   or Dr.GRPO's centred-only variant.
3. ``dynamic_sampling_mask`` / ``zero_std_group_fraction`` -- DAPO's dynamic-sampling filter: groups
   whose rewards are all equal carry no gradient signal.
4. ``rollout_is_weights`` -- the truncated (or masked) importance weight that corrects for the
   rollout/trainer mismatch (the 4-bit sampler with AQN noise vs the trainer's clean forward), token
   or sequence level, as TRL's ``vllm_importance_sampling_mode`` and verl's rollout correction do.
5. ``policy_loss`` -- the PPO clipped surrogate with decoupled clip range (DAPO's clip-higher),
   weighted by the rollout-IS weight, optional k3 KL penalty to a reference policy, optional entropy
   bonus, summed over tokens and divided by the denominators of ``LossNorm`` (GRPO, DAPO, Dr.GRPO or
   the seed's plain REINFORCE). The denominators are fixed per optimizer step, so a step
   accumulated over micro-batches has exactly the gradient of one pass over their union.

Shapes: ``N`` sequences (completions), ``T`` completion tokens (right-padded), ``V`` vocabulary.
Pure torch; no Kedro.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qerl.errors import QerlConfigError
from qerl.rl.logprobs import k3_kl, token_logprobs_and_entropy  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from qerl.params import RLParams

LOSS_TYPES: tuple[str, ...] = ("grpo", "dapo", "dr_grpo", "pg_entropy")
"""Supported ``rl.loss_type`` values (see ``ObjectiveConfig``)."""


# --------------------------------------------------------------------------------------------------
# 2. Group-relative advantages (GRPO / Dr.GRPO)
# --------------------------------------------------------------------------------------------------


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Reshape flat rewards [N] to [N / G, G]; row ``i`` of the input belongs to group ``i // G``."""
    if rewards.dim() != 1:
        raise QerlConfigError("rewards", f"expected a 1-D tensor [N], got shape {tuple(rewards.shape)}",
                              "sum the reward functions into one scalar per completion first")
    if group_size < 1:
        raise QerlConfigError("rl.group_size", f"must be >= 1, got {group_size}",
                              "set the number of samples per prompt (e.g. 8)")
    if rewards.numel() % group_size != 0:
        raise QerlConfigError("rl.group_size", f"{rewards.numel()} rewards are not a multiple of "
                              f"group size {group_size}",
                              "pass all G samples of every prompt, grouped contiguously")
    return rewards.reshape(-1, group_size)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    scale_by_std: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """GRPO's group-relative advantage of every completion.

    ``A_i = (r_i - mean_g(r)) / (std_g(r) + eps)`` where ``g`` is the group (prompt) of sample ``i``
    and ``std`` is the unbiased sample standard deviation (as in TRL). With ``scale_by_std=False``
    the advantage is only centred, ``A_i = r_i - mean_g(r)`` (Dr.GRPO: no std division, which
    otherwise up-weights near-uniform groups). A group of identical rewards gets ``A = 0``.
    ``group_size == 1`` gives all-zero advantages (no baseline, no signal).

    Args:
        rewards: [N] total reward per completion, groups of ``group_size`` contiguous rows.
        group_size: G, samples per prompt.
        scale_by_std: divide by the group std (GRPO) or not (Dr.GRPO).
        eps: added to the std to avoid division by zero.

    Returns:
        [N] float32 advantages.
    """
    if eps < 0:
        raise QerlConfigError("rl.advantage_eps", f"must be >= 0, got {eps}", "use e.g. 1e-4")
    grouped = _grouped(rewards.float(), group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        denom = grouped.std(dim=1, keepdim=True) + eps
        centred = centred / torch.where(denom > 0, denom, torch.ones_like(denom))  # 0/0 -> 0
    return centred.reshape(-1)


# --------------------------------------------------------------------------------------------------
# 3. DAPO dynamic sampling
# --------------------------------------------------------------------------------------------------


def dynamic_sampling_mask(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO's dynamic-sampling filter: keep groups whose rewards are not all equal.

    Args:
        rewards: [N] total reward per completion, groups of ``group_size`` contiguous rows.
        group_size: G, samples per prompt.

    Returns:
        [N] bool, True for every row of a group with at least two different rewards.
    """
    grouped = _grouped(rewards, group_size)
    informative = (grouped != grouped[:, :1]).any(dim=1)
    return informative.repeat_interleave(group_size)


def zero_std_group_fraction(rewards: torch.Tensor, group_size: int) -> float:
    """Fraction of groups whose rewards are all equal (they contribute zero advantage)."""
    grouped = _grouped(rewards, group_size)
    if grouped.shape[0] == 0:
        return 0.0
    return float((grouped == grouped[:, :1]).all(dim=1).float().mean().item())


# --------------------------------------------------------------------------------------------------
# 4. Rollout importance sampling (the rollout/trainer mismatch)
# --------------------------------------------------------------------------------------------------

IS_MODES: tuple[str, ...] = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""``rl.rollout_is`` values: TRL 1.16's four ``vllm_importance_sampling_mode`` values, plus off."""


def rollout_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights ``pi_old / pi_rollout`` of the sampled tokens, truncated or masked at ``cap``.

    ``rho_t = exp(old_t - rollout_t)`` per token (``token_*``), or ``rho = exp(sum_t (old_t -
    rollout_t))`` per sequence broadcast to its tokens (``sequence_*``). ``*_truncate``:
    ``min(rho, cap)``; ``*_mask``: ``rho`` where ``rho <= cap``, else 0 (the token or sequence drops
    out). ``none``: all ones. Detached (a correction, not a gradient path).

    Returns:
        ``(weights [N, T], stats)`` with ``mismatch/kl`` (k3 estimate of KL(rollout || trainer) on the
        sampled tokens), ``mismatch/is_weight_mean``, ``mismatch/is_weight_max`` (of the raw ratio) and
        ``mismatch/is_clipped_frac`` (fraction of tokens truncated or masked).
    """
    if mode not in IS_MODES:
        raise QerlConfigError("rl.rollout_is", f"unknown mode {mode!r}", f"use one of {', '.join(IS_MODES)}")
    valid = mask.bool()
    diff = torch.where(valid, (old_logprobs - rollout_logprobs).detach().float(), torch.zeros(()))
    diff = torch.nan_to_num(diff, nan=0.0)
    if mode.startswith("sequence"):
        rho = torch.exp(diff.sum(dim=1, keepdim=True)).expand_as(diff)
    else:
        rho = torch.exp(diff)
    over = (rho > cap) & valid
    if mode == "none":
        weights = torch.ones_like(rho)
    elif mode.endswith("truncate"):
        weights = torch.clamp(rho, max=cap)
    else:
        weights = torch.where(over, torch.zeros_like(rho), rho)
    n = valid.sum().clamp(min=1)
    kl = k3_kl(torch.where(valid, rollout_logprobs.detach().float(), torch.zeros(())),
               torch.where(valid, old_logprobs.detach().float(), torch.zeros(())))
    stats = {
        "mismatch/kl": float((kl * valid).sum() / n),
        "mismatch/is_weight_mean": float((rho * valid).sum() / n),
        "mismatch/is_weight_max": float(rho[valid].max()) if valid.any() else 1.0,
        "mismatch/is_clipped_frac": float(over.sum() / n) if mode != "none" else 0.0,
    }
    return weights * valid, stats


# --------------------------------------------------------------------------------------------------
# 5. The policy loss
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossNorm:
    """The denominators of one optimizer step's loss, shared by all its micro-batches.

    Attributes:
        tokens: ``dapo`` (and the entropy bonus): the generation batch's completion tokens divided by
            the optimizer steps taken on it (TRL's ``num_items_in_batch / steps_per_generation``), so a
            token's weight does not depend on which minibatch it landed in.
        sequences: ``grpo``, ``dr_grpo``, ``pg_entropy``: sequences in the optimizer step.
        max_completion_length: ``dr_grpo``'s constant per-sequence token budget.
    """

    tokens: float
    sequences: float
    max_completion_length: int | None = None

    @staticmethod
    def of(mask: torch.Tensor, optimizer_steps: int = 1, max_completion_length: int | None = None) -> LossNorm:
        """Denominators for ``mask`` (the whole generation batch) split into ``optimizer_steps``."""
        k = max(1, optimizer_steps)
        return LossNorm(tokens=max(float(mask.sum()), 1.0) / k, sequences=max(mask.shape[0], 1) / k,
                        max_completion_length=max_completion_length)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str, norm: LossNorm) -> torch.Tensor:
    """Reduce a masked [N, T] per-token quantity to this micro-batch's share of the step's scalar.

    ``grpo``: ``sum_i( sum_t m x / max(sum_t m, 1) ) / norm.sequences``; ``dapo``:
    ``sum m x / norm.tokens``; ``dr_grpo``: ``sum m x / (norm.sequences * max_completion_length)``;
    ``pg_entropy``: ``sum_i sum_t m x / norm.sequences``. Summing these over the micro-batches of a
    step gives the step's loss.
    """
    masked = per_token * mask
    if loss_type == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).sum() / norm.sequences
    if loss_type == "dapo":
        return masked.sum() / norm.tokens
    if loss_type == "dr_grpo":
        length = norm.max_completion_length
        if length is None or per_token.shape[1] > length:
            raise QerlConfigError("rollout.max_new_tokens", f"dr_grpo needs the completion budget (got {length}) "
                                  f">= the completion width {per_token.shape[1]}", "set it to the rollout max_new_tokens")
        return masked.sum() / (norm.sequences * length)
    if loss_type == "pg_entropy":
        return masked.sum() / norm.sequences
    raise QerlConfigError("rl.loss_type", f"unknown loss type {loss_type!r}", f"use one of {', '.join(LOSS_TYPES)}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    rl: RLParams,
    norm: LossNorm | None = None,
    *,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss to minimise (this micro-batch's share) and its statistics.

    Per token (``A`` broadcast over the sequence's tokens, ``w`` the rollout-IS weight)::

        ratio    = exp(logp - old_logp)
        clipped  = clip(ratio, 1 - eps_low, 1 + eps_high)
        L_clip   = -min(ratio * A, clipped * A) * w                 # PPO / GRPO / DAPO surrogate
        L_pg     = -(logp * A) * w                                  # pg_entropy (REINFORCE) instead
        L_kl     = beta * (exp(ref - logp) - (ref - logp) - 1)      # k3 KL to the reference
        L_token  = L_clip (or L_pg) + L_kl

    and ``loss = aggregate(L_token) - entropy_coef * sum(m H) / norm.tokens``, with ``rl.loss_type``'s
    aggregation and ``norm``'s denominators (default: this batch alone). Float32 throughout.

    Args:
        logprobs: [N, T] log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: [N, T] the PPO ratio's denominator (rollout or recomputed log-probs).
        advantages: [N] one advantage per sequence.
        mask: [N, T] nonzero for completion tokens (values at padding positions of every other
            per-token tensor are ignored, even inf or nan).
        rl: the ``rl`` settings (loss_type, eps_low, eps_high, beta, entropy_coef).
        norm: the step's denominators (``LossNorm.of`` the whole step's mask).
        ref_logprobs: [N, T] reference log-probs; required when ``rl.beta > 0``.
        entropy: [N, T] per-token entropies; required when ``rl.entropy_coef > 0``.
        is_weights: [N, T] rollout importance weights (``rollout_is_weights``); None = 1.

    Returns:
        ``(loss, stats)`` with ``loss``, ``pg_loss``, ``clip_ratio_low`` (ratio < 1 - eps_low and
        A < 0), ``clip_ratio_high`` (ratio > 1 + eps_high and A > 0), ``clip_ratio``, ``ratio_mean``,
        and ``kl`` / ``entropy`` when given: token means over this micro-batch.
    """
    _check_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, entropy)
    if rl.beta > 0 and ref_logprobs is None:
        raise QerlConfigError("rl.beta", f"is {rl.beta} but no reference log-probs were given",
                              "pass ref_logprobs or set rl.beta to 0")
    if rl.entropy_coef > 0 and entropy is None:
        raise QerlConfigError("rl.entropy_coef", f"is {rl.entropy_coef} but no entropy was given",
                              "pass the per-token entropy or set rl.entropy_coef to 0")
    valid = mask.bool()
    mask_f = valid.to(torch.float32)
    norm = norm or LossNorm.of(mask_f)

    def masked(x: torch.Tensor) -> torch.Tensor:
        # padding zeroed before any exp/log: garbage there can never become inf * 0 = nan
        return torch.where(valid, x.float(), torch.zeros((), dtype=torch.float32, device=x.device))

    logp = masked(logprobs)
    adv = advantages.float().detach().unsqueeze(1)
    weight = masked(is_weights.detach()) if is_weights is not None else mask_f
    ratio = torch.exp(logp - masked(old_logprobs.detach()))

    if rl.loss_type == "pg_entropy":
        per_token = -(logp * adv) * weight
    else:
        clipped = torch.clamp(ratio, 1.0 - rl.eps_low, 1.0 + rl.eps_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv) * weight
    pg_loss = aggregate(per_token, mask_f, rl.loss_type, norm)
    kl = None
    if ref_logprobs is not None:
        kl = k3_kl(logp, masked(ref_logprobs.detach()))
        if rl.beta > 0:
            per_token = per_token + rl.beta * kl
    loss = aggregate(per_token, mask_f, rl.loss_type, norm)
    if rl.entropy_coef > 0 and entropy is not None:
        loss = loss - rl.entropy_coef * (masked(entropy) * mask_f).sum() / norm.tokens

    with torch.no_grad():
        tokens = mask_f.sum().clamp(min=1.0)

        def token_mean(x: torch.Tensor) -> float:
            return float(((x * mask_f).sum() / tokens).item())

        low = ((ratio < 1.0 - rl.eps_low) & (adv < 0)).float()
        high = ((ratio > 1.0 + rl.eps_high) & (adv > 0)).float()
        stats: dict[str, float] = {
            "loss": float(loss.detach()), "pg_loss": float(pg_loss.detach()),
            "clip_ratio_low": token_mean(low), "clip_ratio_high": token_mean(high),
            "clip_ratio": token_mean(low + high), "ratio_mean": token_mean(ratio),
        }
        if kl is not None:
            stats["kl"] = token_mean(kl)
        if entropy is not None:
            stats["entropy"] = token_mean(masked(entropy))
    return loss, stats


def _check_inputs(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, ref_logprobs: torch.Tensor | None, entropy: torch.Tensor | None) -> None:
    """Raise ``QerlConfigError`` on inconsistent shapes."""
    if logprobs.dim() != 2:
        raise QerlConfigError("logprobs", f"expected [N, T], got {tuple(logprobs.shape)}",
                              "pass per-token log-probs of the completions")
    shape = tuple(logprobs.shape)
    for name, tensor in (("old_logprobs", old_logprobs), ("mask", mask), ("ref_logprobs", ref_logprobs),
                         ("entropy", entropy)):
        if tensor is not None and tuple(tensor.shape) != shape:
            raise QerlConfigError(name, f"shape {tuple(tensor.shape)} != logprobs shape {shape}",
                                  "align all per-token tensors to [N, T]")
    if tuple(advantages.shape) != shape[:1]:
        raise QerlConfigError("advantages", f"expected [{shape[0]}], got {tuple(advantages.shape)}",
                              "pass one advantage per sequence")
