"""The FP4 (NVFP4 / MXFP4) matmul of one bf16 row (decode at batch 1): a Triton GEMV over the
stored compressed-tensors layout, read in place, optionally with the group's LoRA in its launch.

At one row a 4-bit GEMM is a pass over the weight bytes and a few integer and float operations per
code; on an H200 the issue rate (about 33 T thread-instructions a second) against 8.4 G codes a
second at the copy bandwidth leaves about 4 instructions a code. So the kernel is built around the
instruction count (checked on the SASS: ``tests/kernels/test_gemv.py``):

* each program owns ``BN`` output features of one member and loops over the input features in
  chunks of ``BK`` (a divisor of ``K``: no masks along K, 16-byte loads); the packed codes are
  read as int32 words of 8 codes;
* the codes ``p`` and ``p + 4`` of a word are decoded together, as the two float16 halves of one
  int32 (sign to bit 15, exponent and mantissa to bits 11..9: the code's value times 2**-14,
  exactly, the subnormal 0.5 included): a mask, a second mask for the sign and two integer
  multiply-adds that move the bits into place, for two codes;
* the bf16 row is read as int32 pairs and widened to float32 by a shift or a mask;
* the products are summed per word, per block of ``G`` codes scaled by the block's scale (16
  codes for NVFP4, 32 for MXFP4), and the blocks once at the end; the NVFP4 global scale divides
  the sum (IEEE division) before the one rounding to bf16;
* up to three members (q, k, v; gate, up) run in one launch, each writing its columns of one
  ``[1, sum N_i]`` output;
* with :class:`GemvLora`, ``(x a_cat^T) b_full^T`` is added before the store: shrink programs
  take the first tickets (the protocol of :mod:`qerl.rollout.fast.lora`) and every GEMV program
  waits for them only after its own dot product.

The result is ``x @ dequantize(W)^T`` up to float32 summation order (tests compare against the
float32 reference).
"""

from __future__ import annotations

import os

import torch

from qerl.kernels.dequant import HAS_TRITON, tl, triton
from qerl.quant.formats import FORMATS

__all__ = ["DECODE_MAX_M", "MAX_MEMBERS", "GemvConfig", "GemvLora", "fp4_gemv",
           "gemv_config"]

MAX_MEMBERS = 3
# Decode rows up to which the fast engine uses it instead of humming (FastEngine(gemv_max_rows=)).
DECODE_MAX_M = 1


class GemvConfig(tuple):
    """``(block_n, block_k, num_warps)`` of one launch (``block_k`` is lowered to a divisor of K)."""

    __slots__ = ()

    def __new__(cls, block_n: int, block_k: int, num_warps: int):
        return super().__new__(cls, (block_n, block_k, num_warps))


class GemvLora:
    """A group's LoRA in the GEMV's launch (the ticket protocol of :mod:`qerl.rollout.fast.lora`):
    ``split`` shrink programs of ``k_per`` features add ``x a_cat^T`` into ``acc`` (two float32
    ``[1, R]`` buffers, used by alternate launches), and every GEMV program adds its tile's
    ``xa b_full^T`` before its store; ``r0``: per output tile of ``block_n`` features, the first
    rank column it reads, ``window`` wide. ``counters`` (int64 ``[2]``) and ``acc`` start at zero
    and then only go to launches of this group shape, on one stream."""

    def __init__(self, a_cat, b_full, acc, counters, r0, window: int, split: int, k_per: int,
                 block_n: int) -> None:
        self.a_cat, self.b_full, self.acc, self.counters, self.r0 = a_cat, b_full, acc, counters, r0
        self.window, self.split, self.k_per, self.block_n = window, split, k_per, block_n

    def check(self, x: torch.Tensor, ns: list[int]) -> int:
        """Refuse a launch that breaks the protocol's invariants; the tile width to use."""
        k = x.shape[1]
        n, r = self.b_full.shape
        bad = [what for what, ok in (
            ("every member's features a multiple of block_n", all(v % self.block_n == 0 for v in ns)),
            ("b_full [sum N_i, R]", n == sum(ns)),
            ("a_cat [R, K]", tuple(self.a_cat.shape) == (r, k)),
            ("one rank start per tile", self.r0.numel() == n // self.block_n),
            ("split covering K", self.split == -(-k // self.k_per)),
            ("acc of 2 R floats", self.acc.dtype == torch.float32 and self.acc.numel() >= 2 * r),
            ("int64 counters [2]", self.counters.dtype == torch.int64 and self.counters.numel() >= 2),
            ("contiguous a_cat, b_full", self.a_cat.is_contiguous() and self.b_full.is_contiguous()),
        ) if not ok]
        if bad:
            raise ValueError(f"fp4_gemv: the LoRA does not fit the launch ({'; '.join(bad)})")
        return self.block_n


def gemv_config(n: int, k: int) -> GemvConfig:
    """The tile of a launch with ``n`` output features in all and ``k`` input features: 64
    features a program where that still gives a few programs per multiprocessor (a thread then
    holds two rows of the same words and widens the input row once for both), else 16."""
    return GemvConfig(64, 256, 4) if n >= 16384 else GemvConfig(16, 512, 4)


def _block_k(k: int, want: int, g: int) -> int:
    """The largest power of two at most ``want`` (and at least 32 and one scale block) that
    divides ``k``; 0 if none does."""
    bk = 1 << (max(want, 1).bit_length() - 1)
    while bk >= max(32, g):
        if k % bk == 0:
            return bk
        bk //= 2
    return 0


if HAS_TRITON:
    from qerl.kernels.dequant import _scale_value

    # the Triton interpreter (CPU tests) gets bf16 dots wrong: there the shrink multiplies in float32
    _F32_DOT = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")

    @triton.jit
    def wait_count(cnt_ptr, want):
        """Spin until the done counter ``cnt_ptr[1]`` reaches ``want`` (acquire)."""
        done = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire")
        while done < want:
            done = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire")

    @triton.jit
    def shrink_slice(x_ptr, sx, a_ptr, acc_ptr, cur, cnt_ptr, lt, launch, M, K, R, SPLIT,
                     BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, ZB: tl.constexpr):
        """A LoRA shrink program (:mod:`qerl.rollout.fast.lora`): features ``[lt * BK, (lt + 1) *
        BK)`` of ``x a^T`` added into this launch's buffer ``cur [M, R]``, its share of the other
        buffer cleared, then counted done (release)."""
        rows = tl.arange(0, BM)
        rmask = rows < M
        rr = tl.arange(0, BR)
        rk = rr < R
        offs = lt * BK + tl.arange(0, BK)
        km = offs < K
        xt = tl.load(x_ptr + rows[:, None] * sx + offs[None, :],
                     mask=rmask[:, None] & km[None, :], other=0.0)
        at = tl.load(a_ptr + rr[:, None] * K + offs[None, :], mask=rk[:, None] & km[None, :],
                     other=0.0)
        if _F32_DOT:
            part = tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)))
        else:
            part = tl.dot(xt, tl.trans(at))
        tl.atomic_add(cur + rows[:, None] * R + rr[None, :], part,
                      mask=rmask[:, None] & rk[None, :], sem="relaxed")
        # clear this ticket's share of the other buffer, which the next launch adds into
        mr = M * R
        share = tl.cdiv(mr, SPLIT)
        z = lt * share + tl.arange(0, ZB)
        tl.store(acc_ptr + (1 - launch % 2) * mr + z, tl.zeros((ZB,), tl.float32),
                 mask=(tl.arange(0, ZB) < share) & (z < mr))
        tl.debug_barrier()  # every thread's additions before the one release below
        tl.atomic_add(cnt_ptr + 1, 1, sem="release")

    @triton.jit
    def _halves(pat):
        """The two float16 halves of int32 ``pat`` as float32 (low, high)."""
        lo = pat.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (pat >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def _codes(w, P: tl.constexpr):
        """Codes ``P`` and ``P + 4`` of the int32 words ``w`` (8 E2M1 codes each, code ``q`` in
        bits ``4q .. 4q + 3``) as float32 values times 2**-14: the magnitude bits moved to bits
        9..11 of each half and the sign bit, left at bit 12 by that, moved on to bit 15 by
        adding 2**15 - 2**12."""
        if P == 0:
            pat = (w & 0x000F000F) * 512 + (w & 0x00080008) * 3584
        elif P == 1:
            pat = (w & 0x00F000F0) * 32 + (w & 0x00800080) * 224
        elif P == 2:
            pat = (w & 0x0F000F00) * 2 + (w & 0x08000800) * 14
        else:  # the signs are in place already; -0x7FFF8000 is 0x80008000 as an int32
            pat = ((w >> 3) & 0x0E000E00) | (w & -0x7FFF8000)
        return _halves(pat)

    @triton.jit
    def _pair_f32(xp):
        """bf16 pairs in int32 (element ``2i`` low, ``2i + 1`` high) to float32 (low, high)."""
        return (xp << 16).to(tl.float32, bitcast=True), (xp & -65536).to(tl.float32, bitcast=True)

    @triton.jit
    def _row_dot(xp_ptr, w_ptr, s_ptr, rows64, rmask, K, SW, SS, E8M0: tl.constexpr,
                 G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """The bf16 row (int32 pairs) against ``BN`` weight rows (int32 words, ``SW`` a row;
        scales ``SS`` a row): ``[BN]`` float32 sums, times 2**14."""
        accg = tl.zeros((BN, BK // G), dtype=tl.float32)
        for k0 in range(0, K, BK):
            wi = k0 // 8 + tl.arange(0, BK // 8)  # the chunk's words
            w = tl.load(w_ptr + rows64[:, None] * SW + wi[None, :], mask=rmask[:, None], other=0)
            # the row's 8 values of each word: pairs (0,1) (2,3) (4,5) (6,7)
            xq = tl.load(xp_ptr + 4 * wi[:, None] + tl.arange(0, 4)[None, :])
            x02, x13 = tl.split(xq.reshape(BK // 8, 2, 2))
            x0, x2 = tl.split(x02)
            x1, x3 = tl.split(x13)
            v0, v1 = _pair_f32(x0)  # x[8j], x[8j + 1]
            v2, v3 = _pair_f32(x1)
            v4, v5 = _pair_f32(x2)
            v6, v7 = _pair_f32(x3)
            a, b = _codes(w, 0)  # one multiply-add chain per word
            accw = tl.fma(b, v4[None, :], a * v0[None, :])
            a, b = _codes(w, 1)
            accw = tl.fma(b, v5[None, :], tl.fma(a, v1[None, :], accw))
            a, b = _codes(w, 2)
            accw = tl.fma(b, v6[None, :], tl.fma(a, v2[None, :], accw))
            a, b = _codes(w, 3)
            accw = tl.fma(b, v7[None, :], tl.fma(a, v3[None, :], accw))
            part = tl.sum(accw.reshape(BN, BK // G, G // 8), axis=2)
            kg = k0 // G + tl.arange(0, BK // G)
            sb = tl.load(s_ptr + rows64[:, None] * SS + kg[None, :], mask=rmask[:, None],
                         other=0)
            if E8M0:
                accg += part * _scale_value(sb.to(tl.int32), E8M0)
            else:  # E4M3 bits: the hardware conversion (Hopper and later)
                accg += part * sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return tl.sum(accg, axis=1)

    @triton.jit
    def _gemv_rows(x_ptr, xp_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, r0, n, col0, K, SW, SS,
                   b_ptr, cur, cnt_ptr, r0_ptr, tile, want, R,
                   HAS_GS: tl.constexpr, E8M0: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, HAS_LORA: tl.constexpr, RS: tl.constexpr, DT: tl.constexpr):
        rows = r0 + tl.arange(0, BN)
        rmask = rows < n
        cols = col0 + rows
        if HAS_LORA:  # the b_full tile first: it does not depend on the shrink
            rs = tl.load(r0_ptr + tile) + tl.arange(0, RS)
            rsm = rs < R
            b = tl.load(b_ptr + cols.to(tl.int64)[:, None] * R + rs[None, :],
                        mask=rmask[:, None] & rsm[None, :], other=0.0).to(tl.float32)
        acc = _row_dot(xp_ptr, w_ptr, s_ptr, rows.to(tl.int64), rmask, K, SW, SS, E8M0, G, BN,
                       BK) * 16384.0
        if HAS_GS:
            acc = tl.math.div_rn(acc, tl.load(gs_ptr).to(tl.float32))
        if HAS_LORA:  # + (x a^T) b^T, the shrink rounded to the model dtype (as the cuBLAS path)
            wait_count(cnt_ptr, want)
            xa = tl.load(cur + rs, mask=rsm, other=0.0, cache_modifier=".cg")
            acc += tl.sum(xa.to(DT).to(tl.float32)[None, :] * b, axis=1)
        tl.store(y_ptr + cols, acc.to(y_ptr.dtype.element_ty), mask=rmask)

    @triton.jit
    def _gemv_tile(tile, x_ptr, xp_ptr, y_ptr, K, SW, SS, w0, s0, g0, n0, w1, s1, g1, n1,
                   w2, s2, g2, n2, b_ptr, cur, cnt_ptr, r0_ptr, want, R, NMEM: tl.constexpr,
                   HAS_GS: tl.constexpr, E8M0: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, HAS_LORA: tl.constexpr, RS: tl.constexpr, DT: tl.constexpr):
        """Output tile ``tile``: ``BN`` features of one member (the members' tiles in order)."""
        t0 = tl.cdiv(n0, BN)
        if tile < t0:
            _gemv_rows(x_ptr, xp_ptr, w0, s0, g0, y_ptr, tile * BN, n0, 0, K, SW, SS, b_ptr, cur,
                       cnt_ptr, r0_ptr, tile, want, R, HAS_GS, E8M0, G, BN, BK, HAS_LORA, RS, DT)
        else:
            if NMEM > 1:
                t1 = tl.cdiv(n1, BN)
                if tile < t0 + t1:
                    _gemv_rows(x_ptr, xp_ptr, w1, s1, g1, y_ptr, (tile - t0) * BN, n1, n0, K, SW,
                               SS, b_ptr, cur, cnt_ptr, r0_ptr, tile, want, R, HAS_GS, E8M0, G,
                               BN, BK, HAS_LORA, RS, DT)
                else:
                    if NMEM > 2:
                        _gemv_rows(x_ptr, xp_ptr, w2, s2, g2, y_ptr, (tile - t0 - t1) * BN, n2,
                                   n0 + n1, K, SW, SS, b_ptr, cur, cnt_ptr, r0_ptr, tile, want, R,
                                   HAS_GS, E8M0, G, BN, BK, HAS_LORA, RS, DT)

    @triton.jit
    def _gemv_kernel(x_ptr, xp_ptr, y_ptr, K, SW, SS, w0, s0, g0, n0, w1, s1, g1, n1, w2, s2, g2,
                     n2, a_ptr, b_ptr, acc_ptr, cnt_ptr, r0_ptr, R, N, SPLIT,
                     NMEM: tl.constexpr, HAS_GS: tl.constexpr, E8M0: tl.constexpr,
                     G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     HAS_LORA: tl.constexpr, KS: tl.constexpr, BR: tl.constexpr,
                     RS: tl.constexpr, ZB: tl.constexpr, DT: tl.constexpr):
        if HAS_LORA:  # tickets, as in qerl.rollout.fast.lora: the first SPLIT ones shrink
            t = tl.atomic_add(cnt_ptr, 1)
            progs = SPLIT + tl.cdiv(N, BN)
            launch = t // progs
            lt = t - launch * progs
            cur = acc_ptr + (launch % 2) * R
            if lt < SPLIT:
                shrink_slice(x_ptr, K, a_ptr, acc_ptr, cur, cnt_ptr, lt, launch, 1, K, R, SPLIT,
                             16, KS, BR, ZB)
            else:
                _gemv_tile(lt - SPLIT, x_ptr, xp_ptr, y_ptr, K, SW, SS, w0, s0, g0, n0, w1, s1,
                           g1, n1, w2, s2, g2, n2, b_ptr, cur, cnt_ptr, r0_ptr,
                           (launch + 1) * SPLIT, R, NMEM, HAS_GS, E8M0, G, BN, BK, True, RS, DT)
        else:
            _gemv_tile(tl.program_id(0), x_ptr, xp_ptr, y_ptr, K, SW, SS, w0, s0, g0, n0, w1, s1,
                       g1, n1, w2, s2, g2, n2, b_ptr, acc_ptr, cnt_ptr, r0_ptr, 0, R, NMEM,
                       HAS_GS, E8M0, G, BN, BK, False, RS, DT)


def _np2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def fp4_gemv(x: torch.Tensor, fmt: str,
             members: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
             out: torch.Tensor | None = None, config: GemvConfig | tuple | None = None,
             lora: GemvLora | None = None) -> torch.Tensor:
    """``x [1, K]`` (bf16) times every member's dequantized weight, transposed: ``[1, sum N_i]``
    (members ``(weight_packed [N_i, K/2], weight_scale [N_i, K/G], global scale or None)``, in
    order, of one format; ``K`` a multiple of 32). CUDA, or CPU under ``TRITON_INTERPRET=1``.
    With ``lora``, plus the group's ``(x a_cat^T) b_full^T`` in the same launch."""
    spec = FORMATS[fmt]
    g = spec.block_size
    if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.bfloat16:
        raise ValueError(f"fp4_gemv: x must be one bf16 row [1, K], got {tuple(x.shape)} {x.dtype}")
    if not 0 < len(members) <= MAX_MEMBERS:
        raise ValueError(f"fp4_gemv: 1 to {MAX_MEMBERS} members, got {len(members)}")
    k = x.shape[1]
    ns = []
    for packed, scale, gscale in members:
        n = packed.shape[0]
        if tuple(packed.shape) != (n, k // 2) or tuple(scale.shape) != (n, k // g) \
                or not (packed.is_contiguous() and scale.is_contiguous()) \
                or (gscale is None) == spec.has_global_scale:
            raise ValueError(f"fp4_gemv: a {fmt} member (packed {tuple(packed.shape)}, scale "
                             f"{tuple(scale.shape)}) does not fit x {tuple(x.shape)}")
        ns.append(n)
    total = sum(ns)
    if out is None:
        out = torch.empty(1, total, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (1, total) or out.stride(1) != 1:
        raise ValueError(f"fp4_gemv: out must be [1, {total}] with unit column stride")
    bn, bk, warps = config or gemv_config(total, k)
    bk = _block_k(k, bk, g)
    if not bk:
        raise ValueError(f"fp4_gemv: K = {k} is not a multiple of {max(32, g)}")
    if lora is not None:
        bn = lora.check(x, ns)
    if not HAS_TRITON:
        raise RuntimeError("fp4_gemv needs Triton (CUDA, or CPU under TRITON_INTERPRET=1)")
    x = x.contiguous()
    args = []
    for i in range(MAX_MEMBERS):
        packed, scale, gscale = members[min(i, len(members) - 1)]
        args += [packed.view(torch.int32), scale.view(torch.uint8),
                 gscale if gscale is not None else out, ns[i] if i < len(members) else 0]
    tiles = sum(triton.cdiv(n, bn) for n in ns)
    if lora is None:
        largs, r, split, lk = [out, out, out, out, out], 0, 0, dict(KS=16, BR=16, RS=16, ZB=16)
    else:
        r, split = lora.b_full.shape[1], lora.split
        largs = [lora.a_cat, lora.b_full, lora.acc, lora.counters, lora.r0]
        lk = dict(KS=lora.k_per, BR=max(16, _np2(r)), RS=lora.window,
                  ZB=max(16, _np2(-(-r // split))))
    _gemv_kernel[(split + tiles,)](
        x, x.view(torch.int32), out, k, k // 8, k // g, *args, *largs, r, total, split,
        NMEM=len(members), HAS_GS=spec.has_global_scale, E8M0=fmt == "mxfp4", G=g, BN=bn, BK=bk,
        HAS_LORA=lora is not None, DT=tl.bfloat16, num_warps=warps, **lk)
    return out
