"""The FP4 (NVFP4 / MXFP4) matmul for a few rows (decode at batch 1): a Triton GEMV that reads the
stored compressed-tensors layout as it is.

At one row a 4-bit GEMM is a pass over the weight bytes, so what counts is the fraction of the
copy bandwidth it reaches. humming's kernels (tensor-core tiles of at least 8 rows, stream-K)
reach 1.8-2.2 TB/s on the large 7B shapes at M = 1 and spend about 11 us on the small ones
(q/k/v, o: 8-10 MB) (docs/benchmarks.md). This kernel is a plain multiply-add over the codes:

* each program owns ``BN`` output features of one member and loops over the input features in
  chunks of ``BK``: it loads the packed bytes (two codes each) and the block scales of its rows,
  and the ``M`` input rows of the chunk;
* an E2M1 code is decoded by placing its bits into a float16 (sign to bit 15, the exponent and
  mantissa bits to bits 11..9: the float16 is the code's value times 2**-14, exactly, the
  subnormal 0.5 included), so a code costs five integer operations and one conversion; the
  2**14 is applied once per output;
* the products are summed per block of ``G`` codes (16 for NVFP4, 32 for MXFP4) in float32,
  multiplied by the block's scale and accumulated; the NVFP4 global scale divides the sum (IEEE
  division) before the one rounding to the output dtype;
* up to three members (q, k, v; gate, up) run in one launch, each writing its columns of one
  ``[M, sum N_i]`` output.

So the result is ``x @ dequantize(W)^T`` up to float32 summation order (tests compare against the
float32 reference). The weights are read in place: no copy in another layout.
"""

from __future__ import annotations

import torch

from qerl.kernels.dequant import HAS_TRITON, tl, triton
from qerl.quant.formats import FORMATS

__all__ = ["DECODE_MAX_M", "LORA_BLOCK_N", "MAX_M", "MAX_MEMBERS", "GemvConfig", "GemvLora", "fp4_gemv",
           "gemv_config"]

MAX_M = 8  # rows the kernel takes (all rows of a chunk are held by one program)
MAX_MEMBERS = 3
# Decode rows up to which the fast engine uses it instead of humming (FastEngine(gemv_max_rows=)).
DECODE_MAX_M = 1
LORA_BLOCK_N = 8  # output features a program owns when the group's LoRA runs in the launch


class GemvConfig(tuple):
    """``(block_n, block_k, num_warps, mul)`` of one launch (``mul``: one-row bf16 launches decode
    both codes of a byte with two multiplies instead of shifts)."""

    __slots__ = ()

    def __new__(cls, block_n: int, block_k: int, num_warps: int, mul: bool = True):
        return super().__new__(cls, (block_n, block_k, num_warps, bool(mul)))


class GemvLora:
    """A group's LoRA in the GEMV's launch (the ticket protocol of :mod:`qerl.rollout.fast.lora`):
    ``split`` shrink programs of ``k_per`` features add ``x a_cat^T`` into ``acc`` (two float32
    ``[M, R]`` buffers, used by alternate launches), and every GEMV program adds its tile's
    ``xa b_full^T`` before its store; ``r0``: per output tile of ``block_n`` features, the first
    rank column it reads, ``window`` wide. ``counters`` (int64 ``[2]``) and ``acc`` start at zero
    and then only go to launches of this group shape and row count, on one stream."""

    def __init__(self, a_cat, b_full, acc, counters, r0, window: int, split: int, k_per: int,
                 block_n: int) -> None:
        self.a_cat, self.b_full, self.acc, self.counters, self.r0 = a_cat, b_full, acc, counters, r0
        self.window, self.split, self.k_per, self.block_n = window, split, k_per, block_n

    def check(self, x: torch.Tensor, ns: list[int]) -> int:
        """Refuse a launch that breaks the protocol's invariants; the tile width to use."""
        m, k = x.shape
        n, r = self.b_full.shape
        bad = [what for what, ok in (
            ("every member's features a multiple of block_n", all(v % self.block_n == 0 for v in ns)),
            ("b_full [sum N_i, R]", n == sum(ns)),
            ("a_cat [R, K]", tuple(self.a_cat.shape) == (r, k)),
            ("one rank start per tile", self.r0.numel() == n // self.block_n),
            ("split covering K", self.split == -(-k // self.k_per)),
            ("acc of 2 M R floats", self.acc.dtype == torch.float32 and self.acc.numel() >= 2 * m * r),
            ("int64 counters [2]", self.counters.dtype == torch.int64 and self.counters.numel() >= 2),
            ("contiguous a_cat, b_full", self.a_cat.is_contiguous() and self.b_full.is_contiguous()),
        ) if not ok]
        if bad:
            raise ValueError(f"fp4_gemv: the LoRA does not fit the launch ({'; '.join(bad)})")
        return self.block_n


def gemv_config(n: int, k: int, m: int) -> GemvConfig:
    """The tile of a launch with ``n`` output features in all, ``k`` input features, ``m`` rows."""
    return GemvConfig(8 if m <= 2 else 4, 512 if k >= 2048 else 256, 4)


if HAS_TRITON:
    from qerl.kernels.dequant import _scale_value

    @triton.jit
    def _e2m1_f16(code):
        """E2M1 codes (int32, 0..15) to float32: the code's value times 2**-14, exactly."""
        bits = ((code & 7) << 9) | ((code & 8) << 12)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

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
    def _e2m1_f16(code):
        """E2M1 codes (int32, 0..15) to float32: the code's value times 2**-14, exactly."""
        bits = ((code & 7) << 9) | ((code & 8) << 12)
        return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _row_dot(xp_ptr, w_ptr, s_ptr, rows64, rmask, K, E8M0: tl.constexpr, G: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, MUL: tl.constexpr):
        """One bf16 input row, read as int32 pairs (``x[2j]`` the low half, ``x[2j + 1]`` the
        high half: the same index as the byte holding codes ``2j`` and ``2j + 1``), against
        ``BN`` weight rows: ``[BN]`` float32 sums (times 2**14). Per chunk the products are
        summed per block and scaled; the blocks are summed once at the end."""
        accg = tl.zeros((BN, BK // G), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kb = k0 // 2 + tl.arange(0, BK // 2)
            km = kb < K // 2
            byte = tl.load(w_ptr + rows64[:, None] * (K // 2) + kb[None, :],
                           mask=rmask[:, None] & km[None, :], other=0).to(tl.int32)
            if MUL:  # both codes' float16 bits in one word: magnitudes, then signs
                # (int32 products wrap; the masks keep bits 9-11, 15 and 25-27, 31: 0x80008000)
                wd = (((byte & 0x77) * 0x00200200) & 0x0E000E00) | (
                    ((byte & 0x88) * 0x01001000) & -0x7FFF8000)
                lo = (wd & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
                hi = ((wd >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            else:
                lo = _e2m1_f16(byte & 15)
                hi = _e2m1_f16(byte >> 4)
            xp = tl.load(xp_ptr + kb, mask=km, other=0)
            xe = (xp << 16).to(tl.float32, bitcast=True)
            xo = ((xp >> 16) << 16).to(tl.float32, bitcast=True)
            part = lo * xe[None, :] + hi * xo[None, :]
            part = tl.sum(part.reshape(BN, BK // G, G // 2), axis=2)
            kg = k0 // G + tl.arange(0, BK // G)
            sb = tl.load(s_ptr + rows64[:, None] * (K // G) + kg[None, :],
                         mask=rmask[:, None] & (kg[None, :] < K // G), other=0).to(tl.int32)
            accg += part * _scale_value(sb, E8M0)
        return tl.sum(accg, axis=1)

    @triton.jit
    def _rows_dot(x_ptr, w_ptr, s_ptr, rows64, rmask, mi, mmask, M, K, sx, E8M0: tl.constexpr,
                  G: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """``MB`` input rows (any float dtype) against ``BN`` weight rows: ``[MB, BN]`` float32
        sums (times 2**14)."""
        acc = tl.zeros((MB, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kb = k0 // 2 + tl.arange(0, BK // 2)
            byte = tl.load(w_ptr + rows64[:, None] * (K // 2) + kb[None, :],
                           mask=rmask[:, None] & (kb[None, :] < K // 2), other=0).to(tl.int32)
            lo = _e2m1_f16(byte & 15)
            hi = _e2m1_f16(byte >> 4)
            kx = k0 + tl.arange(0, BK)
            xv = tl.load(x_ptr + mi[:, None] * sx + kx[None, :],
                         mask=mmask[:, None] & (kx[None, :] < K), other=0.0).to(tl.float32)
            xe, xo = tl.split(xv.reshape(MB, BK // 2, 2))
            part = lo[None, :, :] * xe[:, None, :] + hi[None, :, :] * xo[:, None, :]
            part = tl.sum(part.reshape(MB, BN, BK // G, G // 2), axis=3)
            kg = k0 // G + tl.arange(0, BK // G)
            sb = tl.load(s_ptr + rows64[:, None] * (K // G) + kg[None, :],
                         mask=rmask[:, None] & (kg[None, :] < K // G), other=0).to(tl.int32)
            acc += tl.sum(part * _scale_value(sb, E8M0)[None, :, :], axis=2)
        return acc

    @triton.jit
    def _gemv_rows(x_ptr, xp_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, r0, n, col0, M, K, sx, sy,
                   b_ptr, cur, cnt_ptr, r0_ptr, tile, want, R,
                   HAS_GS: tl.constexpr, E8M0: tl.constexpr, G: tl.constexpr, MB: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, HAS_LORA: tl.constexpr, RS: tl.constexpr,
                   DT: tl.constexpr, ROW1: tl.constexpr, MUL: tl.constexpr):
        rows = r0 + tl.arange(0, BN)
        rmask = rows < n
        rows64 = rows.to(tl.int64)
        cols = col0 + rows
        mi = tl.arange(0, MB)
        mmask = mi < M
        if HAS_LORA:  # the b_full tile first: it does not depend on the shrink
            rs = tl.load(r0_ptr + tile) + tl.arange(0, RS)
            rsm = rs < R
            b = tl.load(b_ptr + cols.to(tl.int64)[:, None] * R + rs[None, :],
                        mask=rmask[:, None] & rsm[None, :], other=0.0).to(tl.float32)
        if ROW1:
            acc = _row_dot(xp_ptr, w_ptr, s_ptr, rows64, rmask, K, E8M0, G, BN, BK, MUL)[None, :]
        else:
            acc = _rows_dot(x_ptr, w_ptr, s_ptr, rows64, rmask, mi, mmask, M, K, sx, E8M0, G, MB,
                            BN, BK)
        acc = acc * 16384.0
        if HAS_GS:
            acc = tl.math.div_rn(acc, tl.load(gs_ptr).to(tl.float32))
        if HAS_LORA:  # + (x a^T) b^T, the shrink rounded to the model dtype (as the cuBLAS path)
            wait_count(cnt_ptr, want)
            xa = tl.load(cur + mi[:, None] * R + rs[None, :], mask=mmask[:, None] & rsm[None, :],
                         other=0.0, cache_modifier=".cg")
            acc += tl.sum(xa.to(DT).to(tl.float32)[:, None, :] * b[None, :, :], axis=2)
        tl.store(y_ptr + mi[:, None] * sy + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & rmask[None, :])

    @triton.jit
    def _gemv_tile(tile, x_ptr, xp_ptr, y_ptr, M, K, sx, sy, w0, s0, g0, n0, w1, s1, g1, n1, w2, s2, g2,
                   n2, b_ptr, cur, cnt_ptr, r0_ptr, want, R, NMEM: tl.constexpr,
                   HAS_GS: tl.constexpr, E8M0: tl.constexpr, G: tl.constexpr, MB: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, HAS_LORA: tl.constexpr, RS: tl.constexpr,
                   DT: tl.constexpr, ROW1: tl.constexpr, MUL: tl.constexpr):
        """Output tile ``tile``: ``BN`` features of one member (the members' tiles in order)."""
        t0 = tl.cdiv(n0, BN)
        if tile < t0:
            _gemv_rows(x_ptr, xp_ptr, w0, s0, g0, y_ptr, tile * BN, n0, 0, M, K, sx, sy, b_ptr, cur,
                       cnt_ptr, r0_ptr, tile, want, R, HAS_GS, E8M0, G, MB, BN, BK, HAS_LORA, RS, DT, ROW1, MUL)
        else:
            if NMEM > 1:
                t1 = tl.cdiv(n1, BN)
                if tile < t0 + t1:
                    _gemv_rows(x_ptr, xp_ptr, w1, s1, g1, y_ptr, (tile - t0) * BN, n1, n0, M, K, sx, sy,
                               b_ptr, cur, cnt_ptr, r0_ptr, tile, want, R, HAS_GS, E8M0, G, MB,
                               BN, BK, HAS_LORA, RS, DT, ROW1, MUL)
                else:
                    if NMEM > 2:
                        _gemv_rows(x_ptr, xp_ptr, w2, s2, g2, y_ptr, (tile - t0 - t1) * BN, n2, n0 + n1,
                                   M, K, sx, sy, b_ptr, cur, cnt_ptr, r0_ptr, tile, want, R,
                                   HAS_GS, E8M0, G, MB, BN, BK, HAS_LORA, RS, DT, ROW1, MUL)

    @triton.jit
    def _gemv_kernel(x_ptr, xp_ptr, y_ptr, M, K, sx, sy, w0, s0, g0, n0, w1, s1, g1, n1, w2, s2, g2, n2,
                     a_ptr, b_ptr, acc_ptr, cnt_ptr, r0_ptr, R, N, SPLIT,
                     NMEM: tl.constexpr, HAS_GS: tl.constexpr, E8M0: tl.constexpr,
                     G: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     HAS_LORA: tl.constexpr, BMS: tl.constexpr, KS: tl.constexpr,
                     BR: tl.constexpr, RS: tl.constexpr, ZB: tl.constexpr, DT: tl.constexpr,
                     ROW1: tl.constexpr, MUL: tl.constexpr):
        if HAS_LORA:  # tickets, as in qerl.rollout.fast.lora: the first SPLIT ones shrink
            t = tl.atomic_add(cnt_ptr, 1)
            progs = SPLIT + tl.cdiv(N, BN)
            launch = t // progs
            lt = t - launch * progs
            cur = acc_ptr + (launch % 2) * (M * R)
            if lt < SPLIT:
                shrink_slice(x_ptr, sx, a_ptr, acc_ptr, cur, cnt_ptr, lt, launch, M, K, R, SPLIT,
                             BMS, KS, BR, ZB)
            else:
                _gemv_tile(lt - SPLIT, x_ptr, xp_ptr, y_ptr, M, K, sx, sy, w0, s0, g0, n0, w1, s1, g1,
                           n1, w2, s2, g2, n2, b_ptr, cur, cnt_ptr, r0_ptr, (launch + 1) * SPLIT,
                           R, NMEM, HAS_GS, E8M0, G, MB, BN, BK, True, RS, DT, ROW1, MUL)
        else:
            _gemv_tile(tl.program_id(0), x_ptr, xp_ptr, y_ptr, M, K, sx, sy, w0, s0, g0, n0, w1, s1, g1,
                       n1, w2, s2, g2, n2, b_ptr, acc_ptr, cnt_ptr, r0_ptr, 0, R, NMEM, HAS_GS,
                       E8M0, G, MB, BN, BK, False, RS, DT, ROW1, MUL)


def _np2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def fp4_gemv(x: torch.Tensor, fmt: str,
             members: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
             out: torch.Tensor | None = None, config: GemvConfig | None = None,
             lora: GemvLora | None = None) -> torch.Tensor:
    """``x [M, K]`` times every member's dequantized weight, transposed: ``[M, sum N_i]``
    (members ``(weight_packed [N_i, K/2], weight_scale [N_i, K/G], global scale or None)``, in
    order, of one format). ``M <= MAX_M``; CUDA, or CPU under ``TRITON_INTERPRET=1``. With
    ``lora``, plus the group's ``(x a_cat^T) b_full^T`` in the same launch (see :class:`GemvLora`)."""
    spec = FORMATS[fmt]
    g = spec.block_size
    if x.dim() != 2 or not 0 < x.shape[0] <= MAX_M:
        raise ValueError(f"fp4_gemv: x must be [M, K] with 1 <= M <= {MAX_M}, got {tuple(x.shape)}")
    if not 0 < len(members) <= MAX_MEMBERS:
        raise ValueError(f"fp4_gemv: 1 to {MAX_MEMBERS} members, got {len(members)}")
    m, k = x.shape
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
        out = torch.empty(m, total, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != (m, total) or out.stride(1) != 1:
        raise ValueError(f"fp4_gemv: out must be [{m}, {total}] with unit column stride")
    bn, bk, warps, mul = GemvConfig(*(config or gemv_config(total, k, m)))
    if lora is not None:
        bn = lora.check(x, ns)
    if not HAS_TRITON:
        raise RuntimeError("fp4_gemv needs Triton (CUDA, or CPU under TRITON_INTERPRET=1)")
    x = x.contiguous()
    args = []
    for i in range(MAX_MEMBERS):
        packed, scale, gscale = members[min(i, len(members) - 1)]
        args += [packed, scale.view(torch.uint8), gscale if gscale is not None else out,
                 ns[i] if i < len(members) else 0]
    tiles = sum(triton.cdiv(n, bn) for n in ns)
    if lora is None:
        largs, r, split, lk = [out, out, out, out, out], 0, 0, dict(BMS=16, KS=16, BR=16, RS=16,
                                                                    ZB=16)
    else:
        r, split = lora.b_full.shape[1], lora.split
        largs = [lora.a_cat, lora.b_full, lora.acc, lora.counters, lora.r0]
        lk = dict(BMS=16, KS=lora.k_per, BR=max(16, _np2(r)), RS=lora.window,
                  ZB=max(16, _np2(-(-m * r // split))))
    dt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]
    row1 = m == 1 and x.dtype == torch.bfloat16  # the row as int32 pairs of bf16 values
    _gemv_kernel[(split + tiles,)](
        x, x.view(torch.int32) if row1 else x, out, m, k, x.stride(0), out.stride(0), *args, *largs,
        r, total, split, NMEM=len(members), HAS_GS=spec.has_global_scale, E8M0=fmt == "mxfp4",
        G=g, MB=_np2(m), BN=bn, BK=bk, HAS_LORA=lora is not None, DT=dt, ROW1=row1, MUL=mul,
        num_warps=warps, **lk)
    return out
