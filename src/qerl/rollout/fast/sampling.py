"""Token sampling for the fast engine: Triton kernels over (row, vocabulary chunk) grids on CUDA
(:func:`sample_kernel`, inside the decode step's CUDA graph), plain torch ops elsewhere
(:func:`sample_tokens_torch`) -- the reference the kernels are tested against, and what they fall
back to when their first-use check fails.

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
        """Integer keys in the order of the logits ``x`` (as loaded: 16- or 32-bit floats), from
        their bit patterns (int32 for 16-bit logits: the search's thresholds fit; else int64); -0 is
        keyed as +0, so equal logits get equal keys."""
        if KEY_BITS == 16:
            b = x.to(tl.int16, bitcast=True).to(tl.int32)
            key = tl.where(b < 0, b ^ 0x7FFF, b)
            return tl.where(key == -1, 0, key)
        else:
            b = x.to(tl.int32, bitcast=True)
            key = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
            return tl.where(key == -1, 0, key).to(tl.int64)

    @triton.jit
    def _key_start(KEY_BITS: tl.constexpr):
        """The search's first lower bound: below every key (int32 for 16-bit logits, else int64)."""
        if KEY_BITS == 16:
            return tl.full([], -(2 ** 15) - 1, tl.int32)
        else:
            return tl.full([], -(2 ** 31) - 1, tl.int64)

    @triton.jit
    def _threshold_step(lo, LEVEL: tl.constexpr, KEY_BITS: tl.constexpr):
        """The distance between LEVEL's 16 thresholds ``lo + k * step``: 16^(levels - LEVEL - 1)."""
        return tl.full([], 1, lo.dtype) << (KEY_BITS - 4 * (LEVEL + 1))

    @triton.jit
    def _masses_above(key, e, lo, LEVEL: tl.constexpr, KEY_BITS: tl.constexpr):
        """``[16]``: the mass ``e`` of the keys above each threshold ``lo + k * step`` of LEVEL's
        interval (k = 0 is ``lo`` itself; :func:`_threshold_step`)."""
        step = _threshold_step(lo, LEVEL, KEY_BITS)
        j = tl.arange(0, 16)
        acc = tl.zeros((16,), tl.float32)
        for k in tl.static_range(16):
            acc = tl.where(j == k, tl.sum(tl.where(key > lo + k * step, e, 0.0), 0), acc)
        return acc

    @triton.jit
    def _scaled(xr, t_ptr, MODE: tl.constexpr):
        """``z``: the logits as float32, over the temperature unless greedy (MODE 0)."""
        if MODE == 0:
            return xr.to(tl.float32)
        return xr.to(tl.float32) / tl.load(t_ptr)

    @triton.jit
    def _row_stats(st_ptr, row, C, CP2: tl.constexpr):
        """The row's softmax statistics from its chunks' (``[B, 4, C]``: max, sum of exp(z - max),
        sum of exp(z - max) (z - max), NaN flag): ``(chunk index, chunk in range, chunk mass
        sum exp(z - m) over the chunk, m, s = sum exp(z - m), w = sum exp(z - m)(z - m), NaN seen)``."""
        c = tl.arange(0, CP2)
        ok = c < C
        base = st_ptr + row.to(tl.int64) * 4 * C
        mc = tl.load(base + c, mask=ok, other=float("-inf"))
        sc = tl.load(base + C + c, mask=ok, other=0.0)
        wc = tl.load(base + 2 * C + c, mask=ok, other=0.0)
        nan = tl.max(tl.load(base + 3 * C + c, mask=ok, other=0.0), 0) > 0
        m = tl.max(mc, 0)
        live = mc > float("-inf")
        d = tl.where(live, mc - m, 0.0)
        scale = tl.where(live, tl.exp(d), 0.0)
        cm = sc * scale
        return c, ok, cm, m, tl.sum(cm, 0), tl.sum((wc + sc * d) * scale, 0), nan, scale

    @triton.jit
    def _stats_kernel(x_ptr, sx, t_ptr, st_ptr, arg_ptr, part_ptr, V, C, MODE: tl.constexpr,
                      KEY_BITS: tl.constexpr, CHUNK: tl.constexpr):
        """Program (row, chunk): the chunk's max, sum of exp, entropy sum and NaN flag (and, greedy,
        its first arg-max: value and index; top-p, the nucleus search's first level, whose thresholds
        do not depend on the row: the masses relative to the chunk's max)."""
        row, ch = tl.program_id(0), tl.program_id(1)
        offs = ch * CHUNK + tl.arange(0, CHUNK)
        xr = tl.load(x_ptr + row.to(tl.int64) * sx + offs, mask=offs < V, other=float("-inf"))
        z = _scaled(xr, t_ptr, MODE)
        mc = tl.max(z, 0)
        live = z > float("-inf")
        d = tl.where(live, z - mc, 0.0)
        e = tl.where(live, tl.exp(d), 0.0)
        base = st_ptr + row.to(tl.int64) * 4 * C + ch
        tl.store(base, mc)
        tl.store(base + C, tl.sum(e, 0))
        tl.store(base + 2 * C, tl.sum(e * d, 0))
        tl.store(base + 3 * C, tl.max((z != z).to(tl.float32), 0))
        if MODE == 0:
            first = tl.min(tl.where(z == mc, offs, 2147483647), 0)
            tl.store(arg_ptr + (row.to(tl.int64) * C + ch) * 2, mc)
            tl.store(arg_ptr + (row.to(tl.int64) * C + ch) * 2 + 1, first.to(tl.float32))
        if MODE == 2:
            acc = _masses_above(_logit_keys(xr, KEY_BITS), e, _key_start(KEY_BITS), 0, KEY_BITS)
            tl.store(part_ptr + (row.to(tl.int64) * C + ch) * 16 + tl.arange(0, 16), acc)

    @triton.jit
    def _level_lo(part_ptr, lo_ptr, row, B, C, target, scale, LEVEL: tl.constexpr,
                  KEY_BITS: tl.constexpr, CP2: tl.constexpr):
        """The nucleus search's lower bound ``lo`` entering LEVEL (the kept keys are > lo; the answer
        lies in (lo, lo + 16^(levels - LEVEL)]), and which threshold of the previous level it is
        (``j``), from that level's masses summed over the chunks (level 0's are relative to each
        chunk's max: times ``scale [CP2]``, exp(chunk max - row max)). The bound entering level 0
        is :func:`_key_start` and is never stored (``lo_ptr``'s first row stays unused); the one
        entering each later level is stored in ``lo_ptr`` by that level's pass."""
        lo = _key_start(KEY_BITS)
        jstar = tl.full([], 0, tl.int32)
        if LEVEL > 0:
            c = tl.arange(0, CP2)
            j = tl.arange(0, 16)
            prev = part_ptr + ((LEVEL - 1) * B + row).to(tl.int64) * C * 16
            chunk_masses = tl.load(prev + c[:, None] * 16 + j[None, :], mask=(c < C)[:, None], other=0.0)
            if LEVEL == 1:
                chunk_masses = chunk_masses * scale[:, None]
            masses = tl.sum(chunk_masses, 0)
            # masses[k]: the mass above lo_prev + k * step, not increasing in k; the last one still >= target
            jstar = tl.sum(((masses >= target) & (j > 0)).to(tl.int32), 0)
            step = _threshold_step(lo, LEVEL - 1, KEY_BITS)  # the previous level's
            if LEVEL > 1:
                lo = tl.load(lo_ptr + (LEVEL - 1) * B + row).to(lo.dtype)
            lo = lo + jstar.to(lo.dtype) * step
        return lo, jstar

    @triton.jit
    def _nucleus_kernel(x_ptr, sx, t_ptr, p_ptr, st_ptr, part_ptr, lo_ptr, V, B, C, LEVEL: tl.constexpr,
                        KEY_BITS: tl.constexpr, CHUNK: tl.constexpr, CP2: tl.constexpr,
                        SKIP: tl.constexpr = True):
        """Program (row, chunk), one level of the 16-ary search for the nucleus: the chunk's mass above
        each of 16 thresholds ``lo + k * step`` of the level's interval (k = 0 is ``lo`` itself);
        ``SKIP``: chunks wholly below or above the interval take a shortcut."""
        row, ch = tl.program_id(0), tl.program_id(1)
        _, _, _, m, s, _, _, scale = _row_stats(st_ptr, row, C, CP2)
        lo, _ = _level_lo(part_ptr, lo_ptr, row, B, C, tl.load(p_ptr) * s, scale, LEVEL, KEY_BITS, CP2)
        if ch == 0:
            tl.store(lo_ptr + LEVEL * B + row, lo.to(tl.int64))
        offs = ch * CHUNK + tl.arange(0, CHUNK)
        xr = tl.load(x_ptr + row.to(tl.int64) * sx + offs, mask=offs < V, other=float("-inf"))
        key = _logit_keys(xr, KEY_BITS)
        # Each level's interval is 16x narrower, so from the second on most chunks lie wholly
        # below it (no mass above any threshold) or, fewer, wholly above it (all of the chunk's
        # mass above every threshold): only chunks that straddle it need the 16 sums.
        if SKIP and tl.max(key, 0) <= lo:
            acc = tl.zeros((16,), tl.float32)
        else:
            z = _scaled(xr, t_ptr, 1)
            e = tl.where(z > float("-inf"), tl.exp(z - m), 0.0)
            if SKIP and tl.min(key, 0) > lo + 15 * _threshold_step(lo, LEVEL, KEY_BITS):
                acc = tl.zeros((16,), tl.float32) + tl.sum(e, 0)
            else:
                acc = _masses_above(key, e, lo, LEVEL, KEY_BITS)
        tl.store(part_ptr + ((LEVEL * B + row).to(tl.int64) * C + ch) * 16 + tl.arange(0, 16), acc)

    @triton.jit
    def _pick_kernel(x_ptr, sx, u_ptr, t_ptr, p_ptr, st_ptr, arg_ptr, part_ptr, lo_ptr, tok_ptr, lp_ptr, ent_ptr,
                     V, B, C, MODE: tl.constexpr, LEVELS: tl.constexpr, KEY_BITS: tl.constexpr,
                     CHUNK: tl.constexpr, CP2: tl.constexpr):
        """Program (row): the token (greedy: the first arg-max; else the inverse CDF in vocabulary
        order, first over the chunks' kept masses, then inside the chunk), its log-prob, the entropy."""
        row = tl.program_id(0)
        c, ok, cm, m, s, w, nan, scale = _row_stats(st_ptr, row, C, CP2)
        if MODE == 0:
            arg = arg_ptr + row.to(tl.int64) * C * 2
            best = tl.load(arg + c * 2, mask=ok, other=float("-inf"))
            idx = tl.load(arg + c * 2 + 1, mask=ok, other=3.0e38)
            tokf = tl.min(tl.where(best == tl.max(best, 0), idx, 3.0e38), 0)
            tok = tl.where(tokf < V, tokf, 0.0).to(tl.int32)  # (NaN logits: no arg-max)
        else:
            lo = _key_start(KEY_BITS)
            if MODE == 2:  # the last level's masses above the final lo, chunk by chunk
                lo, jstar = _level_lo(part_ptr, lo_ptr, row, B, C, tl.load(p_ptr) * s, scale, LEVELS,
                                      KEY_BITS, CP2)
                last = part_ptr + ((LEVELS - 1) * B + row).to(tl.int64) * C * 16
                cm = tl.load(last + c * 16 + jstar, mask=ok, other=0.0)
            target = tl.load(u_ptr + row) * tl.sum(cm, 0)
            cum = tl.cumsum(cm, 0)
            hit = (cum > target) & (cm > 0)
            cstar = tl.min(tl.where(hit, c, CP2), 0)
            cstar = tl.where(cstar == CP2, tl.max(tl.where(cm > 0, c, 0), 0), cstar)  # rounding: past the sum
            target -= tl.sum(tl.where(c == cstar, cum - cm, 0.0), 0)
            offs = cstar * CHUNK + tl.arange(0, CHUNK)
            xr = tl.load(x_ptr + row.to(tl.int64) * sx + offs, mask=offs < V, other=float("-inf"))
            z = _scaled(xr, t_ptr, 1)
            keep = z > float("-inf")
            if MODE == 2:
                keep = keep & (_logit_keys(xr, KEY_BITS) > lo)
            e = tl.where(keep, tl.exp(z - m), 0.0)
            found = (tl.cumsum(e, 0) > target) & (e > 0)
            tok = tl.min(tl.where(found, offs, 2147483647), 0)
            tok = tl.where(tok == 2147483647, tl.max(tl.where(e > 0, offs, 0), 0), tok)
            # (no token with mass at all: a row of -inf or NaN logits gets token 0 and a NaN log-prob)
        zt = _scaled(tl.load(x_ptr + row.to(tl.int64) * sx + tok), t_ptr, MODE)
        ls = tl.log(s)
        lp = zt - m - ls
        ent = ls - w / s
        if nan:  # NaN logits surface as NaN, as in the torch reference (the trainer's guards see them)
            tok = tok * 0
            lp = float("nan")
            ent = float("nan")
        tl.store(tok_ptr + row, tok.to(tl.int64))
        tl.store(lp_ptr + row, lp)
        tl.store(ent_ptr + row, ent)


SAMPLE_MODES = {"greedy": 0, "full": 1, "top_p": 2}


def sample_kernel(logits: torch.Tensor, u: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  mode: str, chunk: int = 4096,
                  skip: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sample_tokens` in Triton kernels over (row, vocabulary chunk) grids: ``(token [B] int64,
    log-prob [B], entropy [B])`` of ``logits [B, V]`` (16- or 32-bit floats).

    One pass over the logits for each chunk's softmax statistics; for ``top_p``, a 16-ary search
    over the logits' order-preserving bit keys for the smallest key whose strictly-greater mass is
    below ``top_p`` (the nucleus without a sort), each level giving every chunk's mass above 16
    thresholds: ``key bits / 4`` levels (4 for bf16/fp16, 8 for float32), the first in the
    statistics pass (its thresholds are the same for every row), each other one a pass more (3 for
    bf16/fp16, 7 for float32; int32 keys for 16-bit logits); then one program a row picks
    the chunk and reads only that chunk for the token. ``chunk``: logits a program reads (a power
    of two, at least 64). ``skip``: from the second level on, a chunk wholly below the level's
    interval adds nothing and one wholly above adds its whole mass to every threshold, without
    the 16 sums (the same result; off only to measure what it saves)."""
    b, v = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev, mode_id = logits.device, SAMPLE_MODES[mode]
    key_bits = 16 if logits.element_size() == 2 else 32
    levels = key_bits // 4
    n_chunks = triton.cdiv(v, chunk)
    cp2 = max(16, triton.next_power_of_2(n_chunks))
    st = torch.empty(b, 4, n_chunks, dtype=torch.float32, device=dev)
    arg = torch.empty(b, n_chunks, 2, dtype=torch.float32, device=dev) if mode_id == 0 else st
    part = torch.empty(levels, b, n_chunks, 16, dtype=torch.float32, device=dev) if mode_id == 2 else st
    lo = torch.empty(levels, b, dtype=torch.long, device=dev) if mode_id == 2 else st
    tok = torch.empty(b, dtype=torch.long, device=dev)
    lp = torch.empty(b, dtype=torch.float32, device=dev)
    ent = torch.empty_like(lp)
    sx = logits.stride(0)
    _stats_kernel[(b, n_chunks)](logits, sx, temperature, st, arg, part, v, n_chunks, MODE=mode_id,
                                 KEY_BITS=key_bits, CHUNK=chunk, num_warps=8 if chunk >= 4096 else 4)
    if mode_id == 2:
        for level in range(1, levels):
            _nucleus_kernel[(b, n_chunks)](logits, sx, temperature, top_p, st, part, lo, v, b, n_chunks,
                                           LEVEL=level, KEY_BITS=key_bits, CHUNK=chunk, CP2=cp2,
                                           SKIP=skip, num_warps=8 if chunk >= 4096 else 4)
    _pick_kernel[(b,)](logits, sx, u, temperature, top_p, st, arg, part, lo, tok, lp, ent, v, b, n_chunks,
                       MODE=mode_id, LEVELS=levels, KEY_BITS=key_bits, CHUNK=chunk, CP2=cp2,
                       num_warps=8 if chunk >= 4096 else 4)
    return tok, lp, ent
