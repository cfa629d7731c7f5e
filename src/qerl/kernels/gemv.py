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

__all__ = ["DECODE_MAX_M", "MAX_M", "MAX_MEMBERS", "GemvConfig", "fp4_gemv", "gemv_config"]

MAX_M = 8  # rows the kernel takes (all rows of a chunk are held by one program)
MAX_MEMBERS = 3
# Decode rows up to which the fast engine uses it instead of humming (FastEngine(gemv_max_rows=)).
DECODE_MAX_M = 1


class GemvConfig(tuple):
    """``(block_n, block_k, num_warps)`` of one launch."""

    __slots__ = ()

    def __new__(cls, block_n: int, block_k: int, num_warps: int):
        return super().__new__(cls, (block_n, block_k, num_warps))


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
    def _gemv_rows(x_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, r0, n, col0, M, K, sx, sy,
                   HAS_GS: tl.constexpr, E8M0: tl.constexpr, G: tl.constexpr, MB: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr):
        rows = r0 + tl.arange(0, BN)
        rmask = rows < n
        rows64 = rows.to(tl.int64)
        mi = tl.arange(0, MB)
        mmask = mi < M
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
        acc = acc * 16384.0
        if HAS_GS:
            acc = tl.math.div_rn(acc, tl.load(gs_ptr).to(tl.float32))
        cols = col0 + rows
        tl.store(y_ptr + mi[:, None] * sy + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & rmask[None, :])

    @triton.jit
    def _gemv_kernel(x_ptr, y_ptr, M, K, sx, sy,
                     w0, s0, g0, n0, w1, s1, g1, n1, w2, s2, g2, n2,
                     NMEM: tl.constexpr, HAS_GS: tl.constexpr, E8M0: tl.constexpr,
                     G: tl.constexpr, MB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid = tl.program_id(0)
        t0 = tl.cdiv(n0, BN)
        if pid < t0:
            _gemv_rows(x_ptr, w0, s0, g0, y_ptr, pid * BN, n0, 0, M, K, sx, sy,
                       HAS_GS, E8M0, G, MB, BN, BK)
        else:
            if NMEM > 1:
                t1 = tl.cdiv(n1, BN)
                if pid < t0 + t1:
                    _gemv_rows(x_ptr, w1, s1, g1, y_ptr, (pid - t0) * BN, n1, n0, M, K, sx, sy,
                               HAS_GS, E8M0, G, MB, BN, BK)
                else:
                    if NMEM > 2:
                        _gemv_rows(x_ptr, w2, s2, g2, y_ptr, (pid - t0 - t1) * BN, n2, n0 + n1,
                                   M, K, sx, sy, HAS_GS, E8M0, G, MB, BN, BK)


def _np2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def fp4_gemv(x: torch.Tensor, fmt: str,
             members: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
             out: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """``x [M, K]`` times every member's dequantized weight, transposed: ``[M, sum N_i]``
    (members ``(weight_packed [N_i, K/2], weight_scale [N_i, K/G], global scale or None)``, in
    order, of one format). ``M <= MAX_M``; CUDA, or CPU under ``TRITON_INTERPRET=1``."""
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
    if not HAS_TRITON:
        raise RuntimeError("fp4_gemv needs Triton (CUDA, or CPU under TRITON_INTERPRET=1)")
    bn, bk, warps = config or gemv_config(total, k, m)
    x = x if x.stride(1) == 1 else x.contiguous()
    args = []
    for i in range(MAX_MEMBERS):
        packed, scale, gscale = members[min(i, len(members) - 1)]
        args += [packed, scale.view(torch.uint8), gscale if gscale is not None else out,
                 ns[i] if i < len(members) else 0]
    grid = (sum(triton.cdiv(n, bn) for n in ns),)
    _gemv_kernel[grid](x, out, m, k, x.stride(0), out.stride(0), *args,
                       NMEM=len(members), HAS_GS=spec.has_global_scale, E8M0=fmt == "mxfp4",
                       G=g, MB=_np2(m), BN=bn, BK=bk, num_warps=warps)
    return out
