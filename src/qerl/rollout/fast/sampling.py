"""Token sampling for the fast engine: one Triton kernel a row on CUDA (:func:`sample_kernel`,
inside the decode step's CUDA graph), plain torch ops elsewhere (:func:`sample_tokens_torch`) --
the reference the kernel is tested against, and what it falls back to when its first-use check
fails.

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
from qerl.rollout.fast.kernels import HAS_TRITON, tl, triton

__all__ = ["nucleus_mask", "sample_kernel", "sample_tokens", "sample_tokens_torch"]

_KERNEL_OK: dict[tuple[torch.device, torch.dtype], bool] = {}


def sample_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: torch.Tensor,
                  top_p: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row of ``logits [B, V]``: ``(token, logprob, entropy)``.

    ``mode``: ``greedy`` (argmax), ``full`` (temperature only) or ``top_p``; ``u [B]`` uniforms
    in [0, 1); ``temperature`` and ``top_p`` are one-element float32 tensors (graph-capture
    friendly). On CUDA the Triton kernel, else :func:`sample_tokens_torch`.
    """
    if logits.is_cuda and HAS_TRITON and _kernel_ok(logits.device, logits.dtype):
        return sample_kernel(logits, u, temperature, top_p, mode)
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
                got, ref = sample_kernel(logits, u, t, p, mode), sample_tokens_torch(logits, u, t, p, mode)
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


if HAS_TRITON:

    @triton.jit
    def _logit_keys(x, KEY_BITS: tl.constexpr):
        """Integer keys (int64) in the order of the logits ``x`` (as loaded: 16- or 32-bit floats),
        from their bit patterns; -0 is keyed as +0, so equal logits get equal keys."""
        if KEY_BITS == 16:
            b = x.to(tl.int16, bitcast=True).to(tl.int32)
            key = tl.where(b < 0, b ^ 0x7FFF, b)
        else:
            b = x.to(tl.int32, bitcast=True)
            key = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
        return tl.where(key == -1, 0, key).to(tl.int64)

    @triton.jit
    def _sample_kernel(x_ptr, sx, u_ptr, t_ptr, p_ptr, tok_ptr, lp_ptr, ent_ptr, V,
                       MODE: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr):
        """One row of :func:`sample_kernel` (MODE 0 greedy, 1 full, 2 top-p): online softmax statistics
        (and the arg-max, or the key range), the top-p threshold by bisection over the keys, then
        the inverse-CDF scan in index order."""
        row = tl.program_id(0)
        base = row.to(tl.int64) * sx
        t = tl.load(t_ptr)
        inv_t = 1.0 / t  # the later passes' exponents (the statistics and the log-prob divide)
        mv = tl.full((BLOCK,), float("-inf"), tl.float32)  # per lane: running max of z,
        sv = tl.zeros((BLOCK,), tl.float32)  # sum of exp(z - mv),
        wv = tl.zeros((BLOCK,), tl.float32)  # sum of exp(z - mv) * (z - mv) (the entropy's, no cancellation)
        nan = tl.zeros((BLOCK,), tl.int32)  # NaN seen
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        bidx = tl.zeros((BLOCK,), tl.int32)
        kmin = tl.full((BLOCK,), 2147483647, tl.int64)
        kmax = tl.full((BLOCK,), -2147483647, tl.int64)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            msk = offs < V
            xr = tl.load(x_ptr + base + offs, mask=msk, other=float("-inf"))
            x = xr.to(tl.float32)
            if MODE == 0:
                z = x
            else:
                z = x / t
            nan = tl.maximum(nan, (z != z).to(tl.int32))
            nm = tl.maximum(mv, z)
            shift = tl.where(mv == float("-inf"), 0.0, mv - nm)  # <= 0; 0 for a lane with nothing yet
            alpha = tl.exp(shift)
            e = tl.where(z > float("-inf"), tl.exp(z - nm), 0.0)
            wv = alpha * (wv + sv * shift) + e * tl.where(e > 0, z - nm, 0.0)
            sv = sv * alpha + e
            mv = nm
            if MODE == 0:
                up = z > best
                best = tl.where(up, z, best)
                bidx = tl.where(up, offs, bidx)
            if MODE == 2:
                key = _logit_keys(xr, KEY_BITS)
                kmin = tl.minimum(kmin, tl.where(msk, key, 2147483647))
                kmax = tl.maximum(kmax, tl.where(msk, key, -2147483647))
        m = tl.max(mv, 0)
        shift = tl.where(mv == float("-inf"), 0.0, mv - m)
        rescale = tl.where(mv == float("-inf"), 0.0, tl.exp(shift))
        s = tl.sum(sv * rescale, 0)
        w = tl.sum((wv + sv * shift) * rescale, 0)  # sum of exp(z - m) * (z - m)
        has_nan = tl.max(nan, 0) > 0
        if MODE == 0:
            top = tl.max(best, 0)
            tok = tl.min(tl.where(best == top, bidx, 2147483647), 0)
        else:
            mass = s  # the kept mass (top-p: the nucleus'), what ``u`` is a fraction of
            lo = tl.min(kmin, 0) - 1  # top-p: the tokens kept are those with key > lo
            if MODE == 2:  # bisection: the smallest key whose strictly-greater mass is < top_p
                hi = tl.max(kmax, 0)
                target_mass = tl.load(p_ptr) * s
                for _ in range(KEY_BITS + 1):
                    if hi - lo > 1:
                        mid = lo + (hi - lo) // 2
                        acc = tl.zeros((BLOCK,), tl.float32)
                        for start in range(0, V, BLOCK):
                            offs = start + tl.arange(0, BLOCK)
                            msk = offs < V
                            xr = tl.load(x_ptr + base + offs, mask=msk, other=float("-inf"))
                            e = tl.exp(xr.to(tl.float32) * inv_t - m)
                            acc += tl.where(msk & (_logit_keys(xr, KEY_BITS) > mid), e, 0.0)
                        above = tl.sum(acc, 0)
                        if above < target_mass:
                            hi = mid
                        else:
                            lo = mid
                            mass = above
            target = tl.load(u_ptr + row) * mass
            c = tl.full([], 0.0, tl.float32)
            tok = tl.full([], -1, tl.int32)  # -1: not found yet
            last = tl.full([], -1, tl.int32)
            for start in range(0, V, BLOCK):
                if tok < 0:
                    offs = start + tl.arange(0, BLOCK)
                    msk = offs < V
                    xr = tl.load(x_ptr + base + offs, mask=msk, other=float("-inf"))
                    z = xr.to(tl.float32) * inv_t
                    keep = msk & (z > float("-inf"))
                    if MODE == 2:
                        keep = keep & (_logit_keys(xr, KEY_BITS) > lo)
                    e = tl.where(keep, tl.exp(z - m), 0.0)
                    cs = tl.cumsum(e, 0)
                    hit = ((c + cs) > target) & (e > 0)
                    first = tl.min(tl.where(hit, offs, 2147483647), 0)
                    if first < 2147483647:
                        tok = first
                    last = tl.maximum(last, tl.max(tl.where(e > 0, offs, -1), 0))
                    c += tl.sum(e, 0)
            tok = tl.where(tok < 0, tl.maximum(last, 0), tok)  # rounding put u * mass past the sum
            # (no token with mass at all: a row of -inf or NaN logits gets token 0 and a NaN log-prob)
        if MODE == 0:
            zt = tl.load(x_ptr + base + tok).to(tl.float32)
        else:
            zt = tl.load(x_ptr + base + tok).to(tl.float32) / t
        ls = tl.log(s)
        lp = zt - m - ls
        ent = ls - w / s
        if has_nan:  # NaN logits surface as NaN, as in the torch reference (the trainer's guards see them)
            tok = tok * 0
            lp = float("nan")
            ent = float("nan")
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, lp)
        tl.store(ent_ptr + row, ent)


SAMPLE_MODES = {"greedy": 0, "full": 1, "top_p": 2}


def sample_kernel(logits: torch.Tensor, u: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` as one Triton kernel a row: ``(token [B] int64,
    log-prob [B], entropy [B])`` of ``logits [B, V]`` (16- or 32-bit floats, unit stride along V).

    Reads the row once for the softmax statistics, once for the inverse-CDF scan (which stops at
    the token) and, for ``top_p``, ``key bits + 1`` more times: a bisection over the logits'
    order-preserving bit keys for the smallest key whose strictly-greater mass is below
    ``top_p`` -- the nucleus without a sort (16 key bits for bf16/fp16 logits)."""
    b, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tok = torch.empty(b, dtype=torch.long, device=logits.device)
    lp = torch.empty(b, dtype=torch.float32, device=logits.device)
    ent = torch.empty_like(lp)
    _sample_kernel[(b,)](logits, logits.stride(0), u, temperature, top_p, tok, lp, ent, v,
                         MODE=SAMPLE_MODES[mode], KEY_BITS=16 if logits.element_size() == 2 else 32,
                         BLOCK=2048, num_warps=8)
    return tok, lp, ent
