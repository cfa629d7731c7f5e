"""Token sampling for the fast engine: plain torch ops, so it runs eagerly on CPU and inside the
decode step's CUDA graph on GPU.

One uniform ``u`` per row and step (drawn by the caller from its generator) picks the token by
inverse CDF: the first token whose cumulative probability exceeds ``u`` times the kept mass (the
whole vocabulary, or the top-p nucleus in descending-logit order). Log-probs and entropies come
from :func:`qerl.rl.logprobs.token_logprobs_and_entropy`, the one implementation the trainer uses
too, on ``logits / T`` (top-p not renormalised; greedy reports ``T = 1``).
"""

from __future__ import annotations

import torch

from qerl.rl.logprobs import token_logprobs_and_entropy

__all__ = ["sample_tokens"]


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
            # sort the logits in their own dtype (bf16: half the radix passes of float32, the
            # same order since ``x`` is their exact float32 copy); stable, so ties keep index order
            _, sidx = torch.sort(logits, stable=True, dim=-1, descending=True)
            sp = p.gather(-1, sidx)
            c = sp.cumsum(dim=-1)
            keep = (c - sp) < top_p
            nkeep = keep.sum(dim=-1, keepdim=True).clamp_min(1)
            mass = c.gather(-1, nkeep - 1)
            j = torch.minimum(torch.searchsorted(c, u.unsqueeze(-1) * mass, right=True), nkeep - 1)
            tok = sidx.gather(-1, j).squeeze(-1)
    lp, ent = token_logprobs_and_entropy(z.unsqueeze(1), tok.unsqueeze(1), 1.0, chunk_size=None)
    return tok, lp.squeeze(1), ent.squeeze(1)
