"""Noise metrics on logits: how far the quantized (and noised) policy is from full precision.

On a fixed probe set, with the full-precision model loaded only for the report:

- ``kl_full_vs_quant``: ``KL(P_full || P_quant)`` per next-token position, mean over valid positions;
- ``entropy``: mean next-token entropy;
- ``noise_report_row``: ``entropy_quant``, ``entropy_full``, ``entropy_gain`` (quant - full) and
  ``kl`` in one row of the noise-metric table.

All computations run in float32 (or the input dtype if wider), ``chunk_size`` positions at a time,
so a ``[positions, V]`` float32 copy of the logits is never materialised at once.
Pure torch; no Kedro.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from qerl.errors import QerlConfigError


def _flatten(logits: torch.Tensor, mask: torch.Tensor | None, field: str) -> torch.Tensor:
    """The valid positions of ``logits`` [..., V] as a [P, V] view/copy."""
    if logits.dim() < 2:
        raise QerlConfigError(field, f"expected [..., V] logits, got shape {tuple(logits.shape)}",
                              "pass logits with the vocabulary as last dimension")
    flat = logits.reshape(-1, logits.shape[-1])
    if mask is not None:
        if tuple(mask.shape) != tuple(logits.shape[:-1]):
            raise QerlConfigError("mask", f"shape {tuple(mask.shape)} does not match logits "
                                  f"positions {tuple(logits.shape[:-1])}",
                                  "pass one mask value per position")
        flat = flat[mask.reshape(-1).bool()]
    if flat.shape[0] == 0:
        raise QerlConfigError("mask", "selects no position", "pass a mask with at least one 1")
    return flat


def _chunked_mean(fn: Callable[..., torch.Tensor], *flats: torch.Tensor, chunk_size: int) -> float:
    """Mean over positions of ``fn(*chunks)`` (one value per position), computed chunk by chunk."""
    if chunk_size < 1:
        raise QerlConfigError("chunk_size", f"must be >= 1, got {chunk_size}", "use e.g. 4096")
    total = torch.zeros((), dtype=torch.float64)
    positions = flats[0].shape[0]
    with torch.no_grad():
        for start in range(0, positions, chunk_size):
            values = fn(*(f[start:start + chunk_size] for f in flats))
            total += values.to(torch.float64).sum().cpu()
    return float(total.item() / positions)


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` in at least float32."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return torch.log_softmax(logits.to(dtype) / temperature, dim=-1)


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature > 0):
        raise QerlConfigError("rollout.temperature", f"must be a finite number > 0, got "
                              f"{temperature!r}", "use the sampling temperature, e.g. 1.0")


def _position_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = _log_probs(logits, temperature)
    p = logp.exp()
    # p log p -> 0 where p == 0 (also for -inf logits, which would otherwise give 0 * -inf = nan).
    return -torch.where(p > 0, p * logp, torch.zeros((), dtype=p.dtype, device=p.device)).sum(-1)


def _position_kl(full: torch.Tensor, quant: torch.Tensor, temperature: float) -> torch.Tensor:
    logp_full = _log_probs(full, temperature)
    logp_quant = _log_probs(quant, temperature)
    p_full = logp_full.exp()
    terms = torch.where(p_full > 0, p_full * (logp_full - logp_quant),
                        torch.zeros((), dtype=p_full.dtype, device=p_full.device))
    # KL >= 0; clamp the last-ulp rounding of near-identical distributions.
    return terms.sum(-1).clamp(min=0.0)


def kl_full_vs_quant(
    full_logits: torch.Tensor,
    quant_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 4096,
) -> float:
    """``KL(P_full || P_quant)``, summed over the vocabulary, averaged over valid positions.

    ``KL = sum_v p_full(v) * (log p_full(v) - log p_quant(v))`` with ``p = softmax(logits / T)``:
    the expected extra log-loss of sampling-policy predictions under the full-precision
    distribution. >= 0, and 0 iff the two distributions agree.

    Note on the seed: it called ``F.kl_div(log_softmax(quant), softmax(full))``. ``F.kl_div(input,
    target)`` computes ``target * (log target - input)``, i.e. KL(target || exp(input)), so that
    argument *order* does give KL(full || quant); the bugs were the default ``reduction='mean'``,
    which averages over batch * positions * **vocabulary** (a value V times too small, as torch's
    own warning says), and the lack of a padding mask. Here the sum runs over the vocabulary and
    the mean over the masked positions only; tests check against
    ``F.kl_div(log_q, log_p, log_target=True, reduction='sum') / positions``.

    Args:
        full_logits: [..., V] logits of the full-precision model.
        quant_logits: [..., V] logits of the quantized (possibly noised) model, same shape.
        mask: [...] nonzero for positions to include; ``None`` includes all.
        temperature: applied to both before the softmax.
        chunk_size: positions processed at a time.
    """
    _check_temperature(temperature)
    if tuple(full_logits.shape) != tuple(quant_logits.shape):
        raise QerlConfigError("quant_logits", f"shape {tuple(quant_logits.shape)} != full_logits "
                              f"shape {tuple(full_logits.shape)}",
                              "run both models on the same probe tokens")
    full = _flatten(full_logits, mask, "full_logits")
    quant = _flatten(quant_logits, mask, "quant_logits")
    return _chunked_mean(lambda f, q: _position_kl(f, q, temperature), full, quant,
                         chunk_size=chunk_size)


def entropy(
    logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 4096,
) -> float:
    """Mean next-token entropy ``-sum_v p log p`` (nats) over valid positions.

    (The seed multiplied the quantized softmax by the *sampled tokens'* log-probs, which is not an
    entropy; this is the entropy of the full next-token distribution.)
    """
    _check_temperature(temperature)
    flat = _flatten(logits, mask, "logits")
    return _chunked_mean(lambda x: _position_entropy(x, temperature), flat, chunk_size=chunk_size)


def noise_report_row(
    full_logits: torch.Tensor,
    quant_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    *,
    step: int | None = None,
    sigma: float | None = None,
    chunk_size: int = 4096,
) -> dict[str, float]:
    """One row of the noise-metric table for a probe batch.

    Returns:
        ``entropy_quant``, ``entropy_full``, ``entropy_gain`` (= quant - full; positive when the
        quantization noise flattens the policy) and ``kl`` (``kl_full_vs_quant``), plus ``step``
        and ``sigma`` when given.
    """
    entropy_quant = entropy(quant_logits, mask, temperature, chunk_size)
    entropy_full = entropy(full_logits, mask, temperature, chunk_size)
    row: dict[str, float] = {}
    if step is not None:
        row["step"] = step
    if sigma is not None:
        row["sigma"] = float(sigma)
    row.update({
        "entropy_quant": entropy_quant,
        "entropy_full": entropy_full,
        "entropy_gain": entropy_quant - entropy_full,
        "kl": kl_full_vs_quant(full_logits, quant_logits, mask, temperature, chunk_size),
    })
    return row
