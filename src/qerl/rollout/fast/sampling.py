"""Token sampling for the fast engine: plain torch ops, so it runs eagerly on CPU and inside the
decode step's CUDA graph on GPU.

One uniform ``u`` per row and step (drawn by the caller from its generator) picks the token by
inverse CDF: the first token whose cumulative probability exceeds ``u`` times the kept mass (the
whole vocabulary, or the top-p nucleus found by :func:`nucleus_threshold`, both in vocabulary order). Log-probs and entropies come
from :func:`qerl.rl.logprobs.token_logprobs_and_entropy`, the one implementation the trainer uses
too, on ``logits / T`` (top-p not renormalised; greedy reports ``T = 1``).
"""

from __future__ import annotations

import torch

from qerl.rl.logprobs import token_logprobs_and_entropy

__all__ = ["nucleus_threshold", "sample_tokens"]

#: bisection steps of :func:`nucleus_threshold` (the threshold is exact to ``max p / 2**steps``)
NUCLEUS_STEPS = 28


def nucleus_threshold(p: torch.Tensor, top_p: torch.Tensor, steps: int = NUCLEUS_STEPS) -> torch.Tensor:
    """The top-p nucleus of each row of probabilities ``p [B, V]`` as a threshold ``tau [B, 1]``:
    the largest ``tau`` with ``sum(p[p >= tau]) >= top_p``, i.e. the probability of the last token
    a descending sort would keep. Found by bisection on ``[0, max p]`` with element-wise ops only:
    no sort, so it is cheap at a 152k vocabulary and can be captured in a CUDA graph (a large
    ``torch.sort`` could not be)."""
    lo = torch.zeros_like(p[:, :1])
    hi = p.amax(dim=-1, keepdim=True)
    for _ in range(steps):
        mid = (lo + hi) * 0.5
        ok = (p * (p >= mid)).sum(dim=-1, keepdim=True) >= top_p
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid)
    # lo keeps mass >= top_p; hi is the row max when that token alone reaches top_p
    alone = p.amax(dim=-1, keepdim=True) >= top_p
    return torch.where(alone, hi, lo)


def sample_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: torch.Tensor,
                  top_p: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]``: ``(token, logprob, entropy)``.

    ``mode``: ``greedy`` (argmax), ``full`` (temperature only) or ``top_p``; ``u [B]`` uniforms
    in [0, 1); ``temperature`` and ``top_p`` are one-element tensors (graph-capture friendly).
    """
    x = logits.float()
    vocab = x.shape[-1]
    if mode == "greedy":
        z = x
        tok = x.argmax(dim=-1)
    else:
        z = x / temperature
        p = torch.softmax(z, dim=-1)
        if mode == "full":
            c = p.cumsum(dim=-1)
            target = (u * c[:, -1]).unsqueeze(-1)
            tok = torch.searchsorted(c, target, right=True).clamp_max(vocab - 1).squeeze(-1)
        else:
            keep = p >= nucleus_threshold(p, top_p)
            c = (p * keep).cumsum(dim=-1)
            target = (u * c[:, -1]).unsqueeze(-1)
            tok = torch.searchsorted(c, target, right=True).clamp_max(vocab - 1).squeeze(-1)
    lp, ent = token_logprobs_and_entropy(z.unsqueeze(1), tok.unsqueeze(1), 1.0, chunk_size=None)
    return tok, lp.squeeze(1), ent.squeeze(1)
