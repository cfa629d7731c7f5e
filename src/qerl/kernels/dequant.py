"""Dequantize an FP4 weight (NVFP4 / MXFP4, compressed-tensors layout) into a reused scratch buffer.

One fused Triton kernel reads the packed codes and block scales once and writes the weight in the
compute dtype; it computes exactly what :mod:`qerl.quant.formats` does (E2M1 value times the block
scale, divided by the NVFP4 global scale with an IEEE division, all in float32, then one rounding
to the output dtype), so its output equals the torch codec's bit for bit.

The scratch: one flat buffer per (device, dtype), grown to the largest weight asked for and shared
by every layer. Reusing it is safe on one CUDA stream (the next layer's dequantization is ordered
after the previous layer's matmul); the training autograd function and the rollout engine's
prefill both use it, so no dequantized weight outlives the matmul that reads it.
"""

from __future__ import annotations

import torch

from qerl.quant.formats import FORMATS

try:  # the GPU machines have Triton; CPU installs and CI may not
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "dequantize_into", "reserve_scratch", "scratch"]

_SCRATCH: dict[tuple[str, int | None, torch.dtype], torch.Tensor] = {}


def scratch(device: torch.device, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    """A ``[rows, cols]`` view of the shared scratch buffer of ``(device, dtype)``.

    The buffer grows (reallocates) when a larger weight is asked for; growing is refused while a
    CUDA graph is being captured (call :func:`reserve_scratch` before capturing).
    """
    key = (device.type, device.index, dtype)
    buf = _SCRATCH.get(key)
    need = rows * cols
    if buf is None or buf.numel() < need:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the FP4 dequantize scratch must be reserved before CUDA graph "
                               "capture (qerl.kernels.dequant.reserve_scratch)")
        _SCRATCH.pop(key, None)
        buf = torch.empty(need, dtype=dtype, device=device)
        _SCRATCH[key] = buf
    return buf[:need].view(rows, cols)


def reserve_scratch(device: torch.device, dtype: torch.dtype, numel: int) -> None:
    """Make sure the scratch of ``(device, dtype)`` holds at least ``numel`` elements."""
    scratch(device, dtype, 1, max(1, numel))


if HAS_TRITON:

    @triton.jit
    def _e2m1_value(code):
        """4-bit E2M1 codes (int32) to float32: sign bit 3, magnitudes 0 .5 1 1.5 2 3 4 6."""
        mag = code & 7
        e = mag >> 1
        m = (mag & 1).to(tl.float32)
        v = tl.where(e == 0, m * 0.5, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
        return tl.where((code & 8) != 0, -v, v)

    @triton.jit
    def _scale_value(s, E8M0: tl.constexpr):
        """Block-scale bits (int32) to float32: E8M0 (MXFP4) or E4M3 (NVFP4), NaN codes kept."""
        if E8M0:
            v = (s << 23).to(tl.float32, bitcast=True)
            v = tl.where(s == 0, tl.full(s.shape, 0x00400000, tl.int32).to(tl.float32,
                                                                           bitcast=True), v)
            return tl.where(s == 255, float("nan"), v)
        e = (s >> 3) & 15
        m = (s & 7).to(tl.float32)
        v = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32)))
        v = tl.where((s & 127) == 127, float("nan"), v)
        return tl.where((s & 128) != 0, -v, v)

    @triton.jit
    def _fp4_dequant_kernel(w_ptr, s_ptr, gs_ptr, out_ptr, N, K, stride_w, stride_s, stride_o,
                            HAS_GS: tl.constexpr, E8M0: tl.constexpr, G: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        k0 = tl.program_id(1) * BK
        rmask = rows[:, None] < N
        rows64 = rows[:, None].to(tl.int64)
        kb = k0 // 2 + tl.arange(0, BK // 2)
        byte = tl.load(w_ptr + rows64 * stride_w + kb[None, :],
                       mask=rmask & (kb[None, :] < K // 2), other=0).to(tl.int32)
        vals = tl.join(_e2m1_value(byte & 15), _e2m1_value(byte >> 4)).reshape(BN, BK)
        kg = k0 // G + tl.arange(0, BK // G)
        sbits = tl.load(s_ptr + rows64 * stride_s + kg[None, :],
                        mask=rmask & (kg[None, :] < K // G), other=0).to(tl.int32)
        sv = _scale_value(sbits, E8M0)
        if HAS_GS:
            sv = tl.math.div_rn(sv, tl.load(gs_ptr).to(tl.float32))
        vals = (vals.reshape(BN, BK // G, G) * sv[:, :, None]).reshape(BN, BK)
        cols = k0 + tl.arange(0, BK)
        tl.store(out_ptr + rows64 * stride_o + cols[None, :], vals.to(out_ptr.dtype.element_ty),
                 mask=rmask & (cols[None, :] < K))


def _dequantize_triton(out: torch.Tensor, fmt: str, packed: torch.Tensor, scale: torch.Tensor,
                       gscale: torch.Tensor | None) -> None:
    spec = FORMATS[fmt]
    n, k = out.shape
    bk = 128
    grid = (triton.cdiv(n, 32), triton.cdiv(k, bk))
    sbits = scale.view(torch.uint8)
    _fp4_dequant_kernel[grid](
        packed, sbits, gscale if gscale is not None else out, out, n, k,
        packed.stride(0), sbits.stride(0), out.stride(0),
        HAS_GS=gscale is not None, E8M0=fmt == "mxfp4", G=spec.block_size, BN=32, BK=bk,
        num_warps=4,
    )


def dequantize_into(out: torch.Tensor, fmt: str, packed: torch.Tensor, scale: torch.Tensor,
                    gscale: torch.Tensor | None = None, impl: str = "triton") -> torch.Tensor:
    """Write the dequantized weight ``[N, K]`` of one FP4 layer into ``out`` (rows may be a slice
    of a larger buffer: ``out.stride(1)`` must be 1) and return ``out``.

    ``impl="triton"`` runs the fused kernel (needs Triton; CUDA, or CPU under TRITON_INTERPRET);
    ``impl="torch"`` the :mod:`qerl.quant.formats` codec. Both give identical values.
    """
    spec = FORMATS[fmt]
    n, k = out.shape
    if tuple(packed.shape) != (n, k // 2) or out.stride(1) != 1:
        raise ValueError(f"{fmt}: output {tuple(out.shape)} (stride {out.stride()}) does not fit "
                         f"weight_packed {tuple(packed.shape)}")
    if impl == "triton":
        if not HAS_TRITON:
            raise RuntimeError("Triton is not installed: use impl='torch'")
        _dequantize_triton(out, fmt, packed.contiguous(), scale.contiguous(), gscale)
        return out
    tensors = {"weight_packed": packed, "weight_scale": scale}
    if spec.has_global_scale:
        tensors["weight_global_scale"] = gscale
    out.copy_(spec.dequantize(tensors, out.dtype))
    return out
