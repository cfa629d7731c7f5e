"""Token sampling for the fast engine: one Triton kernel a row on CUDA (:func:`kernels.sample`,
inside the decode step's CUDA graph), plain torch ops elsewhere -- the reference the kernel is
tested against, and what the kernel falls back to when its first-use check fails.

One uniform ``u`` per row and step (drawn by the caller from its generator) picks the token by
inverse CDF in vocabulary order: the first token whose cumulative probability exceeds ``u`` times
the kept mass. ``full`` keeps the whole vocabulary; ``top_p`` keeps the nucleus, every token whose
strictly-more-probable tokens hold less than ``top_p`` of the mass (tied logits are kept or
dropped together, so no tie is broken by token id). Log-probs and entropies are those of
:func:`qerl.rl.logprobs.token_logprobs_and_entropy`, the one implementation the trainer uses too,
on ``logits / T`` (top-p not renormalised; greedy reports ``T = 1``).
"""

from __future__ import annotations

import warnings

import torch

from qerl.rl.logprobs import token_logprobs_and_entropy
from qerl.rollout.fast import kernels as K

__all__ = ["nucleus_mask", "sample_tokens", "sample_tokens_torch"]

_KERNEL_OK: dict[tuple[torch.device, torch.dtype], bool] = {}


def sample_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: torch.Tensor,
                  top_p: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]``: ``(token, logprob, entropy)``.

    ``mode``: ``greedy`` (argmax), ``full`` (temperature only) or ``top_p``; ``u [B]`` uniforms
    in [0, 1); ``temperature`` and ``top_p`` are one-element float32 tensors (graph-capture
    friendly). On CUDA the Triton kernel, else :func:`sample_tokens_torch`.
    """
    if logits.is_cuda and K.HAS_TRITON and _kernel_ok(logits.device, logits.dtype):
        return K.sample(logits, u, temperature, top_p, mode)
    return sample_tokens_torch(logits, u, temperature, top_p, mode)


def nucleus_mask(p: torch.Tensor, logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` bool: the tokens whose strictly-higher logits hold less than ``top_p`` of the
    probability ``p`` (ties in ``logits`` share their fate)."""
    sv, sidx = torch.sort(logits, dim=-1, descending=True, stable=True)
    sp = p.gather(-1, sidx)
    before = sp.cumsum(dim=-1) - sp  # mass of the tokens sorted before each
    first = torch.ones_like(sv, dtype=torch.bool)
    first[:, 1:] = sv[:, 1:] != sv[:, :-1]
    pos = torch.arange(sv.shape[-1], device=sv.device).expand_as(sv)
    group = torch.where(first, pos, 0).cummax(dim=-1).values  # each tie group's first position
    keep_sorted = before.gather(-1, group) < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, sidx, keep_sorted)


def sample_tokens_torch(logits: torch.Tensor, u: torch.Tensor, temperature: torch.Tensor,
                        top_p: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` in plain torch ops (CPU, and the kernel's reference)."""
    x = logits.float()
    if mode == "greedy":
        z = x
        tok = x.argmax(dim=-1)
    else:
        z = x / temperature
        p = torch.softmax(z, dim=-1)
        if mode == "top_p":
            p = p * nucleus_mask(p, logits, top_p)
        c = p.cumsum(dim=-1)
        tok = torch.searchsorted(c, (u * c[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        pos = torch.arange(p.shape[-1], device=p.device)
        last = torch.where(p > 0, pos, 0).amax(dim=-1)  # rounding put u * mass past the sum
        tok = torch.minimum(tok, last)
    lp, ent = token_logprobs_and_entropy(z.unsqueeze(1), tok.unsqueeze(1), 1.0, chunk_size=None)
    return tok, lp.squeeze(1), ent.squeeze(1)


def _kernel_ok(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Once per device and logits dtype: the kernel compiles and agrees with the torch reference
    on a random problem in every mode (else a warning, and the torch path from then on)."""
    key = (device, dtype)
    if key not in _KERNEL_OK:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            logits = (torch.randn(8, 3000, device=device, generator=g) * 3).to(dtype)
            u = torch.rand(8, device=device, generator=g)
            t, p = (torch.tensor([v], device=device) for v in (0.8, 0.9))
            for mode in ("greedy", "full", "top_p"):
                got, ref = K.sample(logits, u, t, p, mode), sample_tokens_torch(logits, u, t, p, mode)
                same = got[0] == ref[0]  # one row may differ: float32 rounding at a CDF boundary
                if not (int((~same).sum()) <= 1 and torch.allclose(got[1][same], ref[1][same], atol=1e-3)
                        and torch.allclose(got[2], ref[2], atol=1e-3)):
                    raise RuntimeError(f"{mode}: tokens {got[0].tolist()} vs {ref[0].tolist()}")
            _KERNEL_OK[key] = True
        except Exception as e:  # noqa: BLE001 - pragma: no cover - depends on the GPU stack
            warnings.warn(f"fast engine: the Triton sampling kernel failed its check for {dtype} logits "
                          f"({e!r}); sampling with torch ops", stacklevel=3)
            _KERNEL_OK[key] = False
    return _KERNEL_OK[key]
