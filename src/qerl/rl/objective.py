"""The RL objective: group advantages, the clipped policy loss and its aggregations.

Reads top to bottom in the order a trainer uses it:

1. ``token_logprobs_and_entropy`` (:mod:`qerl.rl.logprobs`) -- per-token log-probs (and entropies) of the sampled tokens under
   the current policy, ``log_softmax(logits / temperature)[token]`` (the rollout convention of
   ``qerl.rollout.base``, so rollout and trainer log-probs are comparable).
2. ``group_advantages`` -- GRPO's group-normalised advantage (eq. "A_i = (r_i - mean(r)) / std(r)"),
   or Dr.GRPO's centred-only variant.
3. ``dynamic_sampling_mask`` / ``zero_std_group_fraction`` -- DAPO's dynamic-sampling filter: groups
   whose rewards are all equal carry no gradient signal.
4. ``policy_loss`` -- the PPO clipped surrogate with decoupled clip range (DAPO's clip-higher),
   optional k3 KL penalty to a reference policy, optional entropy bonus, aggregated over tokens as
   GRPO, DAPO, Dr.GRPO or the seed's plain REINFORCE loss prescribe.

Shapes: ``N`` sequences (completions), ``T`` completion tokens (right-padded), ``V`` vocabulary.
Pure torch; no Kedro.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qerl.errors import QerlConfigError
from qerl.rl.logprobs import k3_kl, token_logprobs_and_entropy  # noqa: F401 (re-exported)

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
# 4. The policy loss
# --------------------------------------------------------------------------------------------------


@dataclass
class ObjectiveConfig:
    """Parameters of the policy loss (``rl.*``).

    Attributes:
        loss_type: how per-token losses are aggregated into one scalar:
            ``"grpo"`` -- mean over each sequence's tokens, then mean over sequences;
            ``"dapo"`` -- token level: sum over all tokens / total number of tokens (paper default);
            ``"dr_grpo"`` -- sum over all tokens / (num_seqs * ``max_completion_length``), a
            constant denominator free of length bias;
            ``"pg_entropy"`` -- the seed's plain REINFORCE ``-(log p(seq) * A)`` (no ratio, no
            clipping), summed over each sequence's tokens, mean over sequences, with an entropy
            bonus weighted by ``entropy_coef``.
        eps_low: lower clip range, ratio clipped at ``1 - eps_low``; in [0, 1).
        eps_high: upper clip range, ratio clipped at ``1 + eps_high`` (clip-higher: > eps_low).
        beta: weight of the k3 KL penalty to a reference policy (0 = none, the paper's setting).
        entropy_coef: weight of the entropy bonus (subtracted from the loss); any loss type may use
            it, ``pg_entropy`` is meant to.
        max_completion_length: the constant token budget of ``dr_grpo`` (required for it).
    """

    loss_type: str = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.0
    entropy_coef: float = 0.0
    max_completion_length: int | None = None

    def validate(self) -> ObjectiveConfig:
        """Check every field; raise ``QerlConfigError`` naming the first bad one. Returns self."""
        if self.loss_type not in LOSS_TYPES:
            raise QerlConfigError("rl.loss_type", f"unknown loss type {self.loss_type!r}",
                                  f"use one of {', '.join(LOSS_TYPES)}")
        for name in ("eps_low", "eps_high", "beta", "entropy_coef"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise QerlConfigError(f"rl.{name}", f"must be a finite number >= 0, got {value!r}",
                                      "use the paper's values: eps_low 0.2, eps_high 0.28, beta 0, "
                                      "entropy_coef 0")
        if self.eps_low >= 1:
            raise QerlConfigError("rl.eps_low", f"must be < 1, got {self.eps_low} (the ratio would "
                                  "be clipped at or below 0)", "use e.g. 0.2")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            raise QerlConfigError("rl.max_completion_length",
                                  f"must be >= 1, got {self.max_completion_length}",
                                  "set it to the rollout max_new_tokens")
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise QerlConfigError("rl.max_completion_length", "is required by loss_type 'dr_grpo'",
                                  "set it to the rollout max_new_tokens")
        return self


def _check_inputs(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, ref_logprobs: torch.Tensor | None,
                  entropy: torch.Tensor | None) -> None:
    """Raise ``QerlConfigError`` on inconsistent shapes."""
    if logprobs.dim() != 2:
        raise QerlConfigError("logprobs", f"expected [N, T], got {tuple(logprobs.shape)}",
                              "pass per-token log-probs of the completions")
    shape = tuple(logprobs.shape)
    for name, tensor in (("old_logprobs", old_logprobs), ("mask", mask),
                         ("ref_logprobs", ref_logprobs), ("entropy", entropy)):
        if tensor is not None and tuple(tensor.shape) != shape:
            raise QerlConfigError(name, f"shape {tuple(tensor.shape)} != logprobs shape {shape}",
                                  "align all per-token tensors to [N, T]")
    if tuple(advantages.shape) != shape[:1]:
        raise QerlConfigError("advantages", f"expected [{shape[0]}], got {tuple(advantages.shape)}",
                              "pass one advantage per sequence")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str,
              max_completion_length: int | None = None) -> torch.Tensor:
    """Reduce a masked [N, T] per-token quantity to a scalar as ``loss_type`` prescribes.

    ``grpo``: ``mean_i( sum_t m x / max(sum_t m, 1) )``; ``dapo``: ``sum m x / max(sum m, 1)``;
    ``dr_grpo``: ``sum m x / (N * max_completion_length)``; ``pg_entropy``: ``mean_i( sum_t m x )``.
    """
    masked = per_token * mask
    n = per_token.shape[0]
    if n == 0:
        return masked.sum()
    if loss_type == "grpo":
        return (masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).mean()
    if loss_type == "dapo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise QerlConfigError("rl.max_completion_length", "is required by loss_type 'dr_grpo'",
                                  "set it to the rollout max_new_tokens")
        if per_token.shape[1] > max_completion_length:
            raise QerlConfigError("rl.max_completion_length",
                                  f"{max_completion_length} is smaller than the completion width "
                                  f"{per_token.shape[1]}", "set it to the rollout max_new_tokens")
        return masked.sum() / (n * max_completion_length)
    if loss_type == "pg_entropy":
        return masked.sum(dim=1).mean()
    raise QerlConfigError("rl.loss_type", f"unknown loss type {loss_type!r}",
                          f"use one of {', '.join(LOSS_TYPES)}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: ObjectiveConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss to minimise and its per-step statistics.

    Per token (``A`` broadcast over the sequence's tokens)::

        ratio          = exp(logp - old_logp)
        clipped        = clip(ratio, 1 - eps_low, 1 + eps_high)
        L_clip         = -min(ratio * A, clipped * A)               # PPO / GRPO / DAPO surrogate
        L_pg           = -(logp * A)                                 # pg_entropy (REINFORCE) instead
        L_kl           = beta * (exp(ref - logp) - (ref - logp) - 1) # k3 KL to the reference
        L_token        = L_clip (or L_pg) + L_kl

    and ``loss = aggregate(L_token) - entropy_coef * aggregate(entropy)`` with the aggregation of
    ``cfg.loss_type`` (see ``aggregate``). Computed in float32 whatever the input dtype.

    Args:
        logprobs: [N, T] log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: [N, T] log-probs under the policy that sampled them (no grad needed).
        advantages: [N] one advantage per sequence.
        mask: [N, T] nonzero/True for completion tokens, 0/False for padding (values at padding
            positions of every other per-token tensor are ignored, even inf or nan).
        cfg: the objective's parameters.
        ref_logprobs: [N, T] reference-policy log-probs; required when ``cfg.beta > 0``, otherwise
            only reported as the ``kl`` statistic.
        entropy: [N, T] per-token entropies; required when ``cfg.entropy_coef > 0``.

    Returns:
        ``(loss, stats)``: the scalar loss and python floats ``loss``, ``pg_loss``,
        ``clip_ratio_low`` (fraction of tokens with ratio < 1 - eps_low and A < 0),
        ``clip_ratio_high`` (ratio > 1 + eps_high and A > 0), ``clip_ratio`` (their sum),
        ``ratio_mean``, and ``kl`` (if ``ref_logprobs``) and ``entropy`` (if ``entropy``), all
        token means over the mask.
    """
    cfg.validate()
    _check_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs, entropy)
    if cfg.beta > 0 and ref_logprobs is None:
        raise QerlConfigError("rl.beta", f"is {cfg.beta} but no reference log-probs were given",
                              "pass ref_logprobs or set rl.beta to 0")
    if cfg.entropy_coef > 0 and entropy is None:
        raise QerlConfigError("rl.entropy_coef", f"is {cfg.entropy_coef} but no entropy was given",
                              "pass the per-token entropy or set rl.entropy_coef to 0")

    # Padding positions are zeroed *before* any exp/log so that garbage there (e.g. -inf log-probs)
    # can never turn into inf * 0 = nan in the loss or its gradient.
    valid = mask.bool()
    mask_f = valid.to(torch.float32)

    def masked(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x.float(), torch.zeros((), dtype=torch.float32, device=x.device))

    logp = masked(logprobs)
    adv = advantages.float().detach().unsqueeze(1)  # [N, 1], broadcast over tokens

    # Importance ratio between the current and the sampling policy.
    ratio = torch.exp(logp - masked(old_logprobs.detach()))

    # Policy-gradient term.
    if cfg.loss_type == "pg_entropy":
        per_token = -(logp * adv)
    else:
        clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
    pg_loss = aggregate(per_token, mask_f, cfg.loss_type, cfg.max_completion_length)

    # KL penalty to the reference policy (k3 estimator).
    kl = None
    if ref_logprobs is not None:
        kl = k3_kl(logp, masked(ref_logprobs.detach()))
        if cfg.beta > 0:
            per_token = per_token + cfg.beta * kl

    loss = aggregate(per_token, mask_f, cfg.loss_type, cfg.max_completion_length)

    # Entropy bonus.
    if cfg.entropy_coef > 0 and entropy is not None:
        loss = loss - cfg.entropy_coef * aggregate(masked(entropy), mask_f, cfg.loss_type,
                                                   cfg.max_completion_length)

    with torch.no_grad():
        tokens = mask_f.sum().clamp(min=1.0)

        def token_mean(x: torch.Tensor) -> float:
            return float(((x * mask_f).sum() / tokens).item())

        low = ((ratio < 1.0 - cfg.eps_low) & (adv < 0)).float()
        high = ((ratio > 1.0 + cfg.eps_high) & (adv > 0)).float()
        stats: dict[str, float] = {
            "loss": float(loss.detach().item()),
            "pg_loss": float(pg_loss.detach().item()),
            "clip_ratio_low": token_mean(low),
            "clip_ratio_high": token_mean(high),
            "clip_ratio": token_mean(low + high),
            "ratio_mean": token_mean(ratio),
        }
        if kl is not None:
            stats["kl"] = token_mean(kl)
        if entropy is not None:
            stats["entropy"] = token_mean(masked(entropy))
    return loss, stats
