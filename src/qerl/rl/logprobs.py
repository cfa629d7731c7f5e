"""Log-probs, entropies and KL estimates of sampled tokens: the one implementation that rollout
engines, the trainer, evaluation and the noise report all call.

Convention (shared with :mod:`qerl.rollout.base`): ``logp[n, t] = log_softmax(logits[n, t] / T)[token]``
and ``entropy[n, t] = -sum_v p_v log p_v`` of the same tempered distribution (top-p is not
renormalised). Logits are upcast to float32 a chunk of positions at a time, so no ``[tokens, V]``
float32 copy of the whole batch ever exists.
"""

from __future__ import annotations

import math

import torch

from qerl.errors import QerlConfigError

__all__ = ["k3_kl", "token_logprobs_and_entropy"]


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each sampled token and the entropy of each next-token distribution.

    Args:
        logits: [N, T, V] logits aligned with ``tokens`` (``logits[:, t]`` predicts ``tokens[:, t]``).
        tokens: [N, T] sampled token ids (padding positions may hold any valid id).
        temperature: sampling temperature, > 0.
        chunk_size: positions per chunk; ``None`` processes everything at once. Under
            ``torch.no_grad`` this bounds the extra memory to ``O(chunk_size * V)``.

    Returns:
        ``(logp, entropy)``, both [N, T] float32.
    """
    if logits.dim() != 3:
        raise QerlConfigError("logits", f"expected [N, T, V], got shape {tuple(logits.shape)}",
                              "pass the model's completion logits, one row per sequence")
    if tokens.shape != logits.shape[:2]:
        raise QerlConfigError("tokens", f"shape {tuple(tokens.shape)} does not match logits "
                              f"{tuple(logits.shape[:2])}", "align tokens with logits[:, :, :]")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise QerlConfigError("rollout.temperature", f"must be a finite number > 0, got {temperature}",
                              "use the temperature the rollouts were sampled with (e.g. 1.0)")
    if chunk_size is not None and chunk_size < 1:
        raise QerlConfigError("chunk_size", f"must be >= 1 or None, got {chunk_size}", "use e.g. 1024")

    n, t, v = logits.shape
    flat_logits = logits.reshape(n * t, v)
    flat_tokens = tokens.reshape(n * t, 1).long()
    step = n * t if chunk_size is None else chunk_size
    logp_parts: list[torch.Tensor] = []
    entropy_parts: list[torch.Tensor] = []
    for start in range(0, n * t, max(step, 1)):
        z = flat_logits[start:start + step].float() / temperature
        logp_all = torch.log_softmax(z, dim=-1)
        logp_parts.append(logp_all.gather(-1, flat_tokens[start:start + step]).squeeze(-1))
        p = logp_all.exp()
        if not logp_all.requires_grad:  # -inf logits (masked tokens): p log p = 0, not 0 * -inf = NaN
            logp_all = torch.where(p > 0, logp_all, 0.0)  # (NaN logits stay NaN)
        entropy_parts.append(-(p * logp_all).sum(-1))  # under autograd (the trainer's full-vocabulary
        # LM head) the plain product: the guard would keep one more [tokens, V] tensor for backward
    if not logp_parts:  # N * T == 0
        empty = logits.new_zeros((n, t), dtype=torch.float32)
        return empty, empty.clone()
    return torch.cat(logp_parts).view(n, t), torch.cat(entropy_parts).view(n, t)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref): ``exp(ref - logp) - (ref - logp) - 1`` (>= 0),
    with ``logprobs`` the log-probs of tokens sampled from ``pi``."""
    delta = ref_logprobs - logprobs
    return torch.expm1(delta) - delta  # = exp(d) - d - 1, without cancellation for small d
