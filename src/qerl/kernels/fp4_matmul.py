"""Weight-only FP4 (NVFP4 / MXFP4) matmul: a plain-torch reference and Triton GPU kernels.

Storage (the compressed-tensors layout, see shared/docs/paper-notes.md):

* ``packed`` uint8 ``[out, in/2]``: two E2M1 codes per byte, element ``2j`` in the LOW nibble and
  ``2j+1`` in the HIGH nibble; bit 3 of a code is the sign, bits 0-2 index the magnitudes
  ``0, .5, 1, 1.5, 2, 3, 4, 6``.
* ``scale``: NVFP4 ``float8_e4m3fn [out, in/16]``; MXFP4 ``uint8`` E8M0 ``[out, in/32]`` = ``2^(e-127)``.
* NVFP4 only: ``global_scale`` float32 ``[1]``, stored inverted:
  ``W = e2m1 * scale.float() / global_scale``.

The Triton kernels compute ``y = x @ W^T`` (bf16 activations, fp32 accumulation) reading the packed
weights directly: each 32-bit word of ``packed`` (8 codes) is turned into 8 bf16 values with a
Marlin-style bit trick (inline PTX: the 3 magnitude bits are placed in a bf16 exponent/mantissa so the
word yields ``e2m1 * 2^-126`` in two ``bf16x2`` registers per pair, then one ``mul.bf16x2`` by
``scale * 2^118``; the remaining ``2^8 / global_scale`` is applied to the fp32 accumulator). All of
that is exact: an E2M1 value times an E4M3 / E8M0 scale has at most 6 significant bits, so the only
rounding is the bf16 x bf16 -> fp32 tensor-core product, i.e. the kernel matches
"dequantize in float32, then matmul" to within bf16 rounding of the activations.

Activation layouts: ``x_permuted=False`` reads ``x`` in natural order (the 8 decoded values of a word
are interleaved back in registers); ``x_permuted=True`` expects ``x`` columns stored as
``x_perm[:, (k % 8) * (K // 8) + k // 8] = x[:, k]`` (see :func:`permute_activation`), which lets the
kernel issue 8 dots per tile on contiguous slices without any register shuffles. The rollout engine's
own producer kernels (RMSNorm, attention, SiLU-mul) write that layout directly.

Everything has a CPU fallback (:func:`fp4_linear` dispatches to :func:`fp4_linear_reference` when
the input is not on CUDA or Triton is missing).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP4_FORMATS = ("nvfp4", "mxfp4")
GROUP_SIZE = {"nvfp4": 16, "mxfp4": 32}
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0

try:  # Triton is on the GPU machine; the CPU machines run the torch reference only.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False


# ----------------------------------------------------------------------------------------------
# torch reference (any device)
# ----------------------------------------------------------------------------------------------


def e2m1_table(device=None, dtype=torch.float32) -> torch.Tensor:
    """The 16 E2M1 code values (codes 8..15 are the negatives of 0..7; code 8 is -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags]).to(device=device, dtype=dtype)


def unpack_e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., n/2]`` -> uint8 codes ``[..., n]`` (element 2j from the low nibble)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 data must be uint8, got {packed.dtype}")
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., n/2]`` -> float32 E2M1 values ``[..., n]``."""
    codes = unpack_e2m1_codes(packed)
    return e2m1_table(packed.device)[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., n]`` (values 0..15) -> packed uint8 ``[..., n/2]``."""
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def decode_scale(scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """Block scales as float32: NVFP4 ``float8_e4m3fn`` (or its uint8 bits), MXFP4 E8M0 uint8."""
    if fmt == "nvfp4":
        if scale.dtype == torch.uint8:
            scale = scale.view(torch.float8_e4m3fn)
        return scale.to(torch.float32)
    if fmt == "mxfp4":
        if scale.dtype != torch.uint8:
            raise TypeError(f"MXFP4 scales must be uint8 E8M0, got {scale.dtype}")
        return torch.exp2(scale.to(torch.float32) - 127.0)
    raise ValueError(f"unknown FP4 format {fmt!r}; expected one of {FP4_FORMATS}")


def dequantize_fp4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    global_scale: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain-torch dequantization to ``[out, in]`` (float32 math, cast to ``dtype`` at the end)."""
    vals = unpack_e2m1(packed)
    s = decode_scale(scale, fmt)
    g = GROUP_SIZE[fmt]
    if vals.shape[-1] != s.shape[-1] * g:
        raise ValueError(
            f"{fmt}: packed gives {vals.shape[-1]} columns but scale has {s.shape[-1]} groups of {g}"
        )
    w = (vals.view(*vals.shape[:-1], s.shape[-1], g) * s.unsqueeze(-1)).view(vals.shape)
    if fmt == "nvfp4" and global_scale is not None:
        w = w / global_scale.to(device=w.device, dtype=torch.float32).reshape(-1)[0]
    return w.to(dtype)


def _e2m1_codes_rne(a: torch.Tensor) -> torch.Tensor:
    """|value| (already divided by its block scale) -> 3-bit magnitude code, nearest, ties to even."""
    return (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).to(torch.uint8)


@torch.no_grad()
def quantize_fp4(w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """Vectorised round-to-nearest-even FP4 quantization of a 2-D weight (works on any device).

    A test / benchmark helper with the compressed-tensors conventions (the project's quantized layer
    lives in ``qerl.quant``). Returns ``weight_packed``, ``weight_scale`` and, for NVFP4,
    ``weight_global_scale`` (inverted: ``448 * 6 / amax``).
    """
    if fmt not in FP4_FORMATS:
        raise ValueError(f"unknown FP4 format {fmt!r}")
    out_f, in_f = w.shape
    g = GROUP_SIZE[fmt]
    if in_f % g:
        raise ValueError(f"{fmt} needs in_features divisible by {g}, got {in_f}")
    wf = w.detach().to(torch.float32)
    blocks = wf.view(out_f, in_f // g, g)
    amax = blocks.abs().amax(dim=-1)
    res: dict[str, torch.Tensor] = {}
    if fmt == "nvfp4":
        tensor_amax = wf.abs().max().clamp_min(1e-12)
        gscale = (FP8_E4M3_MAX * E2M1_MAX) / tensor_amax
        s = (amax / E2M1_MAX * gscale).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        sf = s.to(torch.float32)
        eff = torch.where(sf > 0, sf / gscale, torch.ones_like(sf))
        res["weight_scale"] = s
        res["weight_global_scale"] = gscale.reshape(1).to(torch.float32)
    else:
        e = torch.floor(torch.log2(amax.clamp_min(2.0**-127))) - 2.0  # emax(E2M1) = 2
        e = e.clamp(-127, 127)
        res["weight_scale"] = (e + 127).to(torch.uint8)
        eff = torch.exp2(e)
    v = (blocks / eff.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    codes = _e2m1_codes_rne(v.abs()) | ((v < 0).to(torch.uint8) << 3)
    res["weight_packed"] = pack_e2m1(codes.view(out_f, in_f)).contiguous()
    return res


def permute_activation(x: torch.Tensor) -> torch.Tensor:
    """Natural ``[..., K]`` -> the kernels' permuted layout ``[..., (k%8)*(K/8) + k//8]``."""
    K = x.shape[-1]
    return x.reshape(*x.shape[:-1], K // 8, 8).transpose(-1, -2).reshape(x.shape)


def unpermute_activation(xp: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`permute_activation`."""
    K = xp.shape[-1]
    return xp.reshape(*xp.shape[:-1], 8, K // 8).transpose(-1, -2).reshape(xp.shape)


def fp4_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    global_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    lora_xa: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    gate_up: dict | None = None,
    x_permuted: bool = False,
    out_permuted: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Dequantize-then-matmul in float32 (the reference the kernels are checked against).

    ``lora_xa`` [M, r] and ``lora_b`` [N, r] (scaling folded in) add ``lora_xa @ lora_b^T``.
    ``gate_up`` (keys ``packed, scale, global_scale, bias, lora_xa, lora_b``) turns the call into
    ``silu(x W^T) * (x W2^T)`` with bf16 rounding of both halves (as transformers' MLP rounds them).
    """
    out_dtype = out_dtype or x.dtype
    xf = x.to(torch.float32)
    if x_permuted:
        xf = unpermute_activation(xf)

    def one(pk, sc, gs, b, xa, lb):
        w = dequantize_fp4(pk, sc, fmt, gs)
        y = xf @ w.t()
        if b is not None:
            y = y + b.to(torch.float32)
        if xa is not None:
            y = y + xa.to(torch.float32) @ lb.to(torch.float32).t()
        return y

    y = one(packed, scale, global_scale, bias, lora_xa, lora_b)
    if gate_up is not None:
        u = one(
            gate_up["packed"], gate_up["scale"], gate_up.get("global_scale"), gate_up.get("bias"),
            gate_up.get("lora_xa"), gate_up.get("lora_b"),
        )
        g = y.to(out_dtype).to(torch.float32)
        u = u.to(out_dtype).to(torch.float32)
        y = F.silu(g).to(out_dtype).to(torch.float32) * u
    if out_permuted:
        y = permute_activation(y)
    return y.to(out_dtype)


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

#: default activation layout for the engine's decode path (set from the H200 micro-benchmark).
PERMUTED_X_DEFAULT = os.environ.get("QERL_FP4_PERMUTED_X", "0") == "1"
#: use the inline-PTX decode (False: portable pure-Triton decode, also what the interpreter runs).
USE_ASM_DEFAULT = os.environ.get("QERL_FP4_ASM", "1") == "1"


@dataclass(frozen=True)
class Fp4Config:
    """Tile configuration of the fused matmul kernel."""

    BM: int = 16
    BN: int = 128
    BKW: int = 16  # K tile in 32-bit words (8 elements each)
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3
    SWAP: bool = False  # weights as the MMA's A operand (acc^T = W x^T): skinny-M decode


#: a configuration seen compiling and passing on the H200 for every M (the fallback).
SAFE_CONFIG = Fp4Config(BM=16, BN=64, BKW=16, SPLIT_K=1, num_warps=4, num_stages=3, SWAP=False)
_FAILED_CONFIGS: set = set()


if HAS_TRITON:

    # PTX of the 8-code decode: each E2M1 code's 3 magnitude bits go to bf16 bits 8..6 and its
    # sign to bit 15, which reads as ``e2m1 * 2^-126`` (subnormal for codes 0/1); one bf16x2
    # multiply by ``scale * 2^118`` per pair of codes then gives ``e2m1 * scale * 2^-8``.
    _DEQUANT8_PTX = tl.constexpr("""
            {
            .reg .b32 q, t, m, r0, r1, r2, r3, s2;
            .reg .b16 sh;
            mov.b32 q, $8;
            mov.b16 sh, $9;
            mov.b32 s2, {sh, sh};
            shl.b32 t, q, 12;
            and.b32 m, t, 0x70007000;
            shr.b32 m, m, 6;
            and.b32 t, t, 0x80008000;
            or.b32 r0, m, t;
            shl.b32 t, q, 8;
            and.b32 m, t, 0x70007000;
            shr.b32 m, m, 6;
            and.b32 t, t, 0x80008000;
            or.b32 r1, m, t;
            shl.b32 t, q, 4;
            and.b32 m, t, 0x70007000;
            shr.b32 m, m, 6;
            and.b32 t, t, 0x80008000;
            or.b32 r2, m, t;
            and.b32 m, q, 0x70007000;
            shr.b32 m, m, 6;
            and.b32 t, q, 0x80008000;
            or.b32 r3, m, t;
            mul.rn.bf16x2 r0, r0, s2;
            mul.rn.bf16x2 r1, r1, s2;
            mul.rn.bf16x2 r2, r2, s2;
            mul.rn.bf16x2 r3, r3, s2;
            mov.b32 {$0, $4}, r0;
            mov.b32 {$1, $5}, r1;
            mov.b32 {$2, $6}, r2;
            mov.b32 {$3, $7}, r3;
            }
            """)
    _DEQUANT8_CONSTRAINTS = tl.constexpr("=h,=h,=h,=h,=h,=h,=h,=h,r,h")

    @triton.jit
    def _e4m3_bits_to_f32(b):
        b = b.to(tl.int32)
        e = (b >> 3) & 15
        m = (b & 7).to(tl.float32)
        v = tl.where(e == 0, m * 0.001953125, (1.0 + m * 0.125) * tl.exp2((e - 7).to(tl.float32)))
        return tl.where((b & 128) != 0, -v, v)

    @triton.jit
    def _scale_tile(s_ptr, ssn, offs_n, N, g0, NG, GW: tl.constexpr, BN: tl.constexpr,
                    BKW: tl.constexpr, FMT: tl.constexpr, USE_ASM: tl.constexpr):
        """Block scales of a [BN, BKW-word] weight tile, broadcast to one value per word.

        Returned as the factor the decoded codes are multiplied by: ``scale * 2^118`` for the asm
        decode (whose codes come out as ``e2m1 * 2^-126``), ``scale * 2^-8`` for the pure decode,
        so that both give ``e2m1 * scale * 2^-8`` and the epilogue multiplies by ``2^8``.
        """
        NGT: tl.constexpr = BKW // GW
        offs_g = g0 + tl.arange(0, NGT)
        smask = (offs_n[:, None] < N) & (offs_g[None, :] < NG)
        sraw = tl.load(s_ptr + offs_n[:, None].to(tl.int64) * ssn + offs_g[None, :], mask=smask,
                       other=0)
        if FMT == 0:
            sv = _e4m3_bits_to_f32(sraw)
            if USE_ASM:
                sv = sv * 3.3230699894622896e35  # 2^118
            else:
                sv = sv * 0.00390625  # 2^-8
        else:
            if USE_ASM:
                sv = tl.exp2(sraw.to(tl.float32) - 9.0)  # 2^(e-127) * 2^118
            else:
                sv = tl.exp2(sraw.to(tl.float32) - 135.0)  # 2^(e-127) * 2^-8
        if GW == 2:
            sv = tl.reshape(tl.join(sv, sv), (BN, BKW))
        else:
            sv2 = tl.join(sv, sv)
            sv = tl.reshape(tl.join(sv2, sv2), (BN, BKW))
        return sv

    @triton.jit
    def _dequant8_asm(q, s):
        """int32 words (8 codes) x bf16 factor -> 8 bf16 tensors n0..n7 (n_j = code j of the word)."""
        return tl.inline_asm_elementwise(asm=_DEQUANT8_PTX, constraints=_DEQUANT8_CONSTRAINTS,
                                         args=[q, s], dtype=(tl.bfloat16,) * 8, is_pure=True,
                                         pack=1)

    @triton.jit
    def _dequant8_asm_impure(q, s):
        """As :func:`_dequant8_asm` but not rematerialisable: the permuted-x path consumes the 8
        results by 8 different dots, and the compiler's layout rematerialisation of a
        multi-result asm op gave wrong results there (H200, Triton 3.6)."""
        return tl.inline_asm_elementwise(asm=_DEQUANT8_PTX, constraints=_DEQUANT8_CONSTRAINTS,
                                         args=[q, s], dtype=(tl.bfloat16,) * 8, is_pure=False,
                                         pack=1)

    @triton.jit
    def _e2m1_code_to_f32(c):
        mag = c & 7
        e = mag >> 1
        m = (mag & 1).to(tl.float32)
        v = tl.where(e == 0, m * 0.5, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
        return tl.where((c & 8) != 0, -v, v)

    @triton.jit
    def _dequant8_pure(q, s, DT: tl.constexpr):
        n0 = (_e2m1_code_to_f32(q & 15) * s).to(DT)
        n1 = (_e2m1_code_to_f32((q >> 4) & 15) * s).to(DT)
        n2 = (_e2m1_code_to_f32((q >> 8) & 15) * s).to(DT)
        n3 = (_e2m1_code_to_f32((q >> 12) & 15) * s).to(DT)
        n4 = (_e2m1_code_to_f32((q >> 16) & 15) * s).to(DT)
        n5 = (_e2m1_code_to_f32((q >> 20) & 15) * s).to(DT)
        n6 = (_e2m1_code_to_f32((q >> 24) & 15) * s).to(DT)
        n7 = (_e2m1_code_to_f32((q >> 28) & 15) * s).to(DT)
        return n0, n1, n2, n3, n4, n5, n6, n7

    @triton.jit
    def _interleave8(n0, n1, n2, n3, n4, n5, n6, n7, BN: tl.constexpr, BKW: tl.constexpr):
        a = tl.join(tl.join(n0, n4), tl.join(n2, n6))
        b = tl.join(tl.join(n1, n5), tl.join(n3, n7))
        return tl.reshape(tl.join(a, b), (BN, BKW * 8))

    @triton.jit
    def _dot_perm(acc, x_ptr, sxm, offs_m, M, KW, ww, w_hi, nj, J: tl.constexpr,
                  SWAP: tl.constexpr):
        if SWAP:
            xmask = (offs_m[None, :] < M) & (ww[:, None] < w_hi)
            xj = tl.load(x_ptr + offs_m[None, :] * sxm + (J * KW + ww)[:, None], mask=xmask,
                         other=0.0)
            return tl.dot(nj, xj, acc)
        xmask = (offs_m[:, None] < M) & (ww[None, :] < w_hi)
        xj = tl.load(x_ptr + offs_m[:, None] * sxm + (J * KW + ww)[None, :], mask=xmask, other=0.0)
        return tl.dot(xj, tl.trans(nj), acc)

    @triton.jit
    def _fp4_acc(acc, x_ptr, sxm, w_ptr, swn, s_ptr, ssn, offs_m, offs_n, M, N, KW, NG, w_lo, w_hi,
                 W_SPLIT, FMT: tl.constexpr, GW: tl.constexpr, USE_ASM: tl.constexpr,
                 PERM_X: tl.constexpr, SWAP: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr):
        offs_w = tl.arange(0, BKW)
        offs_k = tl.arange(0, BKW * 8)
        n64 = offs_n[:, None].to(tl.int64)
        for kw in range(w_lo, w_lo + W_SPLIT, BKW):
            ww = kw + offs_w
            wmask = (offs_n[:, None] < N) & (ww[None, :] < w_hi)
            q = tl.load(w_ptr + n64 * swn + ww[None, :], mask=wmask, other=0)
            sv = _scale_tile(s_ptr, ssn, offs_n, N, kw // GW, NG, GW, BN, BKW, FMT, USE_ASM)
            if USE_ASM:
                if PERM_X:
                    n0, n1, n2, n3, n4, n5, n6, n7 = _dequant8_asm_impure(q, sv.to(tl.bfloat16))
                else:
                    n0, n1, n2, n3, n4, n5, n6, n7 = _dequant8_asm(q, sv.to(tl.bfloat16))
            else:
                n0, n1, n2, n3, n4, n5, n6, n7 = _dequant8_pure(q, sv, x_ptr.dtype.element_ty)
            if PERM_X:
                acc = _dot_perm(acc, x_ptr, sxm, offs_m, M, KW, ww, w_hi, n0, 0, SWAP)
                acc = _dot_perm(acc, x_ptr, sxm, offs_m, M, KW, ww, w_hi, n1, 1, SWAP)
                acc = _dot_perm(acc, x_ptr, sxm, offs_m, M, KW, ww, w_hi, n2, 2, SWAP)
                acc = _dot_perm(acc, x_ptr, sxm, offs_m, M, KW, ww, w_hi, n3, 3, SWAP)
                acc = _dot_perm(acc, x_ptr, sxm, offs_m, M, KW, ww, w_hi, n4, 4, SWAP)
                acc = _dot_perm(acc, x_ptr, sxm, offs_m, M, KW, ww, w_hi, n5, 5, SWAP)
                acc = _dot_perm(acc, x_ptr, sxm, offs_m, M, KW, ww, w_hi, n6, 6, SWAP)
                acc = _dot_perm(acc, x_ptr, sxm, offs_m, M, KW, ww, w_hi, n7, 7, SWAP)
            else:
                wt = _interleave8(n0, n1, n2, n3, n4, n5, n6, n7, BN, BKW)
                kk = kw * 8 + offs_k
                if SWAP:  # acc [BN, BM] = W [BN, BK] @ x^T [BK, BM]: weights are the MMA's A
                    xmask = (offs_m[None, :] < M) & (kk[:, None] < w_hi * 8)
                    xt = tl.load(x_ptr + offs_m[None, :] * sxm + kk[:, None], mask=xmask,
                                 other=0.0)
                    acc = tl.dot(wt, xt, acc)
                else:
                    xmask = (offs_m[:, None] < M) & (kk[None, :] < w_hi * 8)
                    xt = tl.load(x_ptr + offs_m[:, None] * sxm + kk[None, :], mask=xmask,
                                 other=0.0)
                    acc = tl.dot(xt, tl.trans(wt), acc)
        return acc

    @triton.jit
    def _epilogue_one(acc, gs_ptr, bias_ptr, xa_ptr, sxa, lb_ptr, slb, offs_m, offs_n, M, N, R,
                      FMT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                      RP: tl.constexpr):
        if FMT == 0:
            acc = acc * (256.0 / tl.load(gs_ptr).to(tl.float32))
        else:
            acc = acc * 256.0
        if HAS_BIAS:
            b = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
            acc = acc + b[None, :]
        if HAS_LORA:
            offs_r = tl.arange(0, RP)
            xa = tl.load(xa_ptr + offs_m[:, None] * sxa + offs_r[None, :],
                         mask=(offs_m[:, None] < M) & (offs_r[None, :] < R), other=0.0)
            lb = tl.load(lb_ptr + offs_n[:, None].to(tl.int64) * slb + offs_r[None, :],
                         mask=(offs_n[:, None] < N) & (offs_r[None, :] < R), other=0.0)
            acc = tl.dot(xa, tl.trans(lb), acc)
        return acc

    @triton.jit
    def _finish(acc, acc2, gs_ptr, bias_ptr, xa_ptr, sxa, lb_ptr, slb, gs2_ptr, bias2_ptr,
                xa2_ptr, lb2_ptr, y_ptr, sym, offs_m, offs_n, mn_mask, M, N, R,
                FMT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                RP: tl.constexpr, SILU: tl.constexpr, PERM_OUT: tl.constexpr):
        acc = _epilogue_one(acc, gs_ptr, bias_ptr, xa_ptr, sxa, lb_ptr, slb, offs_m, offs_n,
                            M, N, R, FMT, HAS_BIAS, HAS_LORA, RP)
        if SILU:
            acc2 = _epilogue_one(acc2, gs2_ptr, bias2_ptr, xa2_ptr, sxa, lb2_ptr, slb, offs_m,
                                 offs_n, M, N, R, FMT, HAS_BIAS, HAS_LORA, RP)
            OT: tl.constexpr = y_ptr.dtype.element_ty
            g = acc.to(OT).to(tl.float32)
            u = acc2.to(OT).to(tl.float32)
            acc = (g * tl.sigmoid(g)).to(OT).to(tl.float32) * u
        if PERM_OUT:
            col = (offs_n % 8) * (N // 8) + offs_n // 8
        else:
            col = offs_n
        tl.store(y_ptr + offs_m[:, None] * sym + col[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mn_mask)

    @triton.jit
    def _fp4_mm_kernel(
        x_ptr, sxm, w_ptr, swn, s_ptr, ssn, gs_ptr, bias_ptr,
        w2_ptr, s2_ptr, gs2_ptr, bias2_ptr,
        xa_ptr, sxa, lb_ptr, slb, xa2_ptr, lb2_ptr, R,
        y_ptr, sym, ws_ptr, cnt_ptr,
        M, N, KW, NG, W_PER_SPLIT,
        FMT: tl.constexpr, GW: tl.constexpr, USE_ASM: tl.constexpr, PERM_X: tl.constexpr,
        PERM_OUT: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_LORA: tl.constexpr, RP: tl.constexpr, SPLIT_K: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BKW: tl.constexpr, SWAP: tl.constexpr,
    ):
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        mt = tl.cdiv(M, BM)
        pid_m = pid % mt
        pid_n = pid // mt
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        w_lo = pid_k * W_PER_SPLIT
        w_hi = tl.minimum(w_lo + W_PER_SPLIT, KW)

        if SWAP:
            acc = tl.zeros((BN, BM), dtype=tl.float32)
        else:
            acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc = _fp4_acc(acc, x_ptr, sxm, w_ptr, swn, s_ptr, ssn, offs_m, offs_n, M, N, KW, NG,
                       w_lo, w_hi, W_PER_SPLIT, FMT, GW, USE_ASM, PERM_X, SWAP, BN, BKW)
        if SWAP:
            acc = tl.trans(acc)
        if SILU:
            if SWAP:
                acc2 = tl.zeros((BN, BM), dtype=tl.float32)
            else:
                acc2 = tl.zeros((BM, BN), dtype=tl.float32)
            acc2 = _fp4_acc(acc2, x_ptr, sxm, w2_ptr, swn, s2_ptr, ssn, offs_m, offs_n, M, N, KW,
                            NG, w_lo, w_hi, W_PER_SPLIT, FMT, GW, USE_ASM, PERM_X, SWAP, BN, BKW)
            if SWAP:
                acc2 = tl.trans(acc2)
        else:
            acc2 = acc
        mn_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if SPLIT_K > 1:
            # split-K: each split stores its fp32 partial tile (no atomics); the reduction and
            # the epilogue run in _fp4_splitk_finish_kernel right after, in the same stream.
            ws_off = offs_m[:, None] * N + offs_n[None, :]
            tl.store(ws_ptr + pid_k * M * N + ws_off, acc, mask=mn_mask)
            if SILU:
                tl.store(ws_ptr + (SPLIT_K + pid_k) * M * N + ws_off, acc2, mask=mn_mask)
        else:
            _finish(acc, acc2, gs_ptr, bias_ptr, xa_ptr, sxa, lb_ptr, slb, gs2_ptr, bias2_ptr,
                    xa2_ptr, lb2_ptr, y_ptr, sym, offs_m, offs_n, mn_mask, M, N, R, FMT,
                    HAS_BIAS, HAS_LORA, RP, SILU, PERM_OUT)

    @triton.jit
    def _fp4_splitk_finish_kernel(
        ws_ptr, gs_ptr, bias_ptr, gs2_ptr, bias2_ptr, xa_ptr, sxa, lb_ptr, slb, xa2_ptr, lb2_ptr,
        R, y_ptr, sym, M, N,
        FMT: tl.constexpr, PERM_OUT: tl.constexpr, SILU: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_LORA: tl.constexpr, RP: tl.constexpr, SPLIT_K: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr,
    ):
        pid = tl.program_id(0)
        mt = tl.cdiv(M, BM)
        offs_m = (pid % mt) * BM + tl.arange(0, BM)
        offs_n = (pid // mt) * BN + tl.arange(0, BN)
        mn_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        ws_off = offs_m[:, None] * N + offs_n[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(SPLIT_K):
            acc += tl.load(ws_ptr + k * M * N + ws_off, mask=mn_mask, other=0.0)
            if SILU:
                acc2 += tl.load(ws_ptr + (SPLIT_K + k) * M * N + ws_off, mask=mn_mask, other=0.0)
        _finish(acc, acc2, gs_ptr, bias_ptr, xa_ptr, sxa, lb_ptr, slb, gs2_ptr, bias2_ptr,
                xa2_ptr, lb2_ptr, y_ptr, sym, offs_m, offs_n, mn_mask, M, N, R, FMT,
                HAS_BIAS, HAS_LORA, RP, SILU, PERM_OUT)

    @triton.jit
    def _fp4_dequant_kernel(w_ptr, swn, s_ptr, ssn, gs_ptr, out_ptr, son, N, KW, NG,
                            FMT: tl.constexpr, GW: tl.constexpr, USE_ASM: tl.constexpr,
                            BN: tl.constexpr, BKW: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        kw = pid_k * BKW
        ww = kw + tl.arange(0, BKW)
        wmask = (offs_n[:, None] < N) & (ww[None, :] < KW)
        q = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * swn + ww[None, :], mask=wmask, other=0)
        sv = _scale_tile(s_ptr, ssn, offs_n, N, kw // GW, NG, GW, BN, BKW, FMT, USE_ASM)
        if USE_ASM:
            n0, n1, n2, n3, n4, n5, n6, n7 = _dequant8_asm(q, sv.to(tl.bfloat16))
        else:
            n0, n1, n2, n3, n4, n5, n6, n7 = _dequant8_pure(q, sv, tl.float32)
        wt = _interleave8(n0, n1, n2, n3, n4, n5, n6, n7, BN, BKW).to(tl.float32)
        if FMT == 0:
            wt = wt * (256.0 / tl.load(gs_ptr).to(tl.float32))
        else:
            wt = wt * 256.0
        kk = kw * 8 + tl.arange(0, BKW * 8)
        omask = (offs_n[:, None] < N) & (kk[None, :] < KW * 8)
        tl.store(out_ptr + offs_n[:, None].to(tl.int64) * son + kk[None, :],
                 wt.to(out_ptr.dtype.element_ty), mask=omask)


_WORKSPACES: dict = {}


def _workspace(device: torch.device, numel: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A zeroed fp32 workspace and tile counters for split-K (kernels leave them zeroed)."""
    key = (device.type, device.index)
    ws, cnt = _WORKSPACES.get(key, (None, None))
    if ws is None or ws.numel() < numel or cnt.numel() < tiles:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fp4 split-K workspace must be reserved before CUDA graph capture "
                               "(call reserve_workspace)")
        n_ws = max(numel, ws.numel() if ws is not None else 0, 1 << 20)
        n_cnt = max(tiles, cnt.numel() if cnt is not None else 0, 4096)
        ws = torch.zeros(n_ws, dtype=torch.float32, device=device)
        cnt = torch.zeros(n_cnt, dtype=torch.int32, device=device)
        _WORKSPACES[key] = (ws, cnt)
    return ws, cnt


def reserve_workspace(device: torch.device, max_m: int = 0, max_n: int = 0) -> None:
    """Allocate the split-K workspace up front (needed before capturing a CUDA graph).

    :func:`pick_config` only splits K while ``tiles * split < 2 * SMs``, so a call's partials
    (``split * M * N`` floats, twice for gate/up) stay under ``2 * 4 * SMs * BM * BN`` floats
    (at most 128 x 256 tiles): about 140 MB on an H200 whatever the model.
    """
    device = torch.device(device)
    sms = _num_sms(device) if device.type == "cuda" else 132
    _workspace(device, 2 * 4 * sms * 128 * 256, 65536)


_NUM_SMS: dict = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


#: tuned overrides, filled from the H200 micro-benchmark: (M-bucket, silu) -> config fields.
CONFIG_TABLE: dict[tuple[int, bool], dict] = {
    # H200 sweep (benchmarks/fp4_matmul.py --sweep --tuning-out, 2026-11-30 10:34 UTC, the 7B
    # shapes; benchmarks/results/fp4_tuning_h200.json). Two stages and 16-word K tiles halve the
    # shared memory of the old 3-stage / 32-word tiles (one 8-warp block per SM, 12.5% occupancy
    # in Nsight Compute) and more programs fill the 132 SMs: M=1 and 16 +40%, M=64 +11%;
    # M=32 from a second sweep (10:39 UTC) took the 32B B=32 rollout from 1141 to 1327 tok/s.
    (16, False): {"SWAP": True, "BM": 16, "BN": 64, "BKW": 16, "num_warps": 4, "num_stages": 2,
                  "programs": 528},
    (16, True): {"SWAP": True, "BM": 16, "BN": 64, "BKW": 32, "num_warps": 4, "num_stages": 2,
                 "programs": 528},
    (32, False): {"SWAP": True, "BM": 32, "BN": 64, "BKW": 16, "num_warps": 4, "num_stages": 3,
                  "programs": 396},
    (32, True): {"SWAP": True, "BM": 32, "BN": 64, "BKW": 16, "num_warps": 4, "num_stages": 3,
                 "programs": 396},
    (64, False): {"SWAP": True, "BM": 64, "BN": 64, "BKW": 16, "num_warps": 4, "num_stages": 2,
                  "programs": 528},
    (64, True): {"SWAP": True, "BM": 64, "BN": 128, "BKW": 16, "num_warps": 8, "num_stages": 3,
                 "programs": 396},
    # BM=128 tiles run out of shared memory / registers: 64-row tiles over M instead
    (128, False): {"SWAP": True, "BM": 64, "BN": 128, "BKW": 32, "num_warps": 8},
    (128, True): {"SWAP": True, "BM": 64, "BN": 128, "BKW": 32, "num_warps": 8},
    (256, False): {"SWAP": True, "BM": 64, "BN": 128, "BKW": 32, "num_warps": 8},
    (256, True): {"SWAP": True, "BM": 64, "BN": 128, "BKW": 32, "num_warps": 8},
}


_TUNABLE = ("SWAP", "BM", "BN", "BKW", "num_warps", "num_stages", "programs", "SPLIT_K")
_M_BUCKETS = (16, 32, 64, 128, 256)


def _parse_tuning(data: object, where: str) -> dict[tuple[int, bool], dict]:
    """Validate a tile table (see :func:`load_tuning`) into ``CONFIG_TABLE`` entries."""
    fix = (f"keys look like '64,False' (M bucket in {_M_BUCKETS}, then True/False for fused "
           f"gate/up), values are objects with some of {_TUNABLE}; benchmarks/fp4_matmul.py "
           "--tuning-out writes such a file")
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a tile table must be a JSON object; {fix}")
    out: dict[tuple[int, bool], dict] = {}
    for key, cfg in data.items():
        parts = [p.strip() for p in str(key).split(",")]
        if len(parts) != 2 or not parts[0].isdigit() or int(parts[0]) not in _M_BUCKETS \
                or parts[1].lower() not in ("true", "false"):
            raise ValueError(f"{where}: bad tile-table key {key!r}; {fix}")
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: tile-table entry {key!r} is not an object; {fix}")
        unknown = sorted(set(cfg) - set(_TUNABLE))
        if unknown:
            raise ValueError(f"{where}: tile-table entry {key!r} has unknown fields {unknown}; {fix}")
        for k, v in cfg.items():
            ok = isinstance(v, bool) if k == "SWAP" else (
                isinstance(v, int) and not isinstance(v, bool) and v > 0)
            if not ok:
                raise ValueError(f"{where}: tile-table entry {key!r}: {k}={v!r} must be "
                                 + ("true or false" if k == "SWAP" else "a positive integer"))
        out[(int(parts[0]), parts[1].lower() == "true")] = dict(cfg)
    return out


def load_tuning(path: str | os.PathLike) -> dict:
    """Merge a tile table written by ``benchmarks/fp4_matmul.py --tuning-out`` into
    :data:`CONFIG_TABLE` (keys ``"<M-bucket>,<silu>"``, e.g. ``"64,False"``); returns what was read.

    The whole file is validated before anything is merged. Also read at import from the file
    named by ``QERL_FP4_TUNING`` (a file that cannot be used there gives a warning, not an error).
    """
    with open(path) as f:
        data = json.load(f)
    CONFIG_TABLE.update(_parse_tuning(data, str(path)))
    return data


if os.environ.get("QERL_FP4_TUNING"):
    try:
        load_tuning(os.environ["QERL_FP4_TUNING"])
    except (OSError, ValueError) as _e:
        import warnings as _warnings

        _warnings.warn(f"QERL_FP4_TUNING ignored, the built-in tile table is used: {_e}",
                       stacklevel=2)


def _m_bucket(M: int) -> int:
    for b in (16, 32, 64, 128):
        if M <= b:
            return b
    return 256


def pick_config(M: int, N: int, K: int, silu: bool = False, device=None) -> Fp4Config:
    """Tile choice: swap-AB for decode (weights are the MMA's M side, the batch its N side),
    enough programs to fill the GPU (split-K when N is small)."""
    mb = _m_bucket(M)
    base = dict(CONFIG_TABLE.get((mb, silu), {}))
    swap = base.get("SWAP", True)
    if swap:
        BM = base.get("BM", min(max(16, mb), 128))
        BN = base.get("BN", 64 if silu else 128)
    else:
        BM = base.get("BM", 16)
        BN = base.get("BN", 64)
    BKW = base.get("BKW", 32)
    num_warps = base.get("num_warps", 4)
    num_stages = base.get("num_stages", 3)
    KW = K // 8
    tiles = triton_cdiv(M, BM) * triton_cdiv(N, BN)
    sms = _num_sms(device) if device is not None and device.type == "cuda" else 132
    split = split_k_for(tiles, K, BKW, base.get("programs", 2 * sms))
    if "SPLIT_K" in base:
        split = min(base["SPLIT_K"], max(1, KW // (BKW * 2)))
    return Fp4Config(BM=BM, BN=BN, BKW=BKW, SPLIT_K=split, num_warps=num_warps,
                     num_stages=num_stages, SWAP=swap)


def split_k_for(tiles: int, K: int, BKW: int, programs: int) -> int:
    """Split-K factor (a power of two) that brings ``tiles`` output tiles up to about
    ``programs`` programs, keeping at least two ``BKW``-word K tiles in every split."""
    max_split = max(1, (K // 8) // (BKW * 2))
    split = 1
    while tiles * split < programs and split * 2 <= max_split:
        split *= 2
    return split


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fmt_code(fmt: str) -> int:
    if fmt == "nvfp4":
        return 0
    if fmt == "mxfp4":
        return 1
    raise ValueError(f"unknown FP4 format {fmt!r}")


def fp4_linear_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    global_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    lora_xa: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    gate_up: dict | None = None,
    x_permuted: bool = False,
    out_permuted: bool = False,
    out: torch.Tensor | None = None,
    config: Fp4Config | None = None,
    use_asm: bool | None = None,
) -> torch.Tensor:
    """Fused weight-only FP4 matmul on the GPU (see module docstring). ``x`` [M, K] bf16."""
    if not HAS_TRITON:
        raise RuntimeError("Triton is not available")
    if x.dim() != 2:
        raise ValueError("fp4_linear_triton takes a 2-D x")
    M, K = x.shape
    N = packed.shape[0]
    if packed.shape[1] * 2 != K:
        raise ValueError(f"x has K={K} but packed weight is {tuple(packed.shape)}")
    if K % 32 and fmt == "mxfp4" or K % 16:
        raise ValueError(f"{fmt}: K={K} must be a multiple of the group size")
    if x.stride(1) != 1:
        x = x.contiguous()
    use_asm = USE_ASM_DEFAULT if use_asm is None else use_asm
    fc = _fmt_code(fmt)
    GW = GROUP_SIZE[fmt] // 8
    cfg = config or pick_config(M, N, K, silu=gate_up is not None, device=x.device)
    BKW = max(cfg.BKW, GW)
    KW = K // 8
    NG = K // GROUP_SIZE[fmt]
    wq = packed.view(torch.int32)
    sq = scale.view(torch.uint8)
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    split = max(1, cfg.SPLIT_K)
    per_split = triton_cdiv(triton_cdiv(KW, split), BKW) * BKW
    split = triton_cdiv(KW, per_split)
    tiles = triton_cdiv(M, cfg.BM) * triton_cdiv(N, cfg.BN)
    silu = gate_up is not None
    if split > 1:
        ws, cnt = _workspace(x.device, (2 if silu else 1) * split * M * N, tiles)
    else:
        ws, cnt = out, out  # unused
    dummy = x
    gs = global_scale if global_scale is not None else dummy
    has_lora = lora_xa is not None
    R = lora_xa.shape[1] if has_lora else 0
    RP = max(16, triton.next_power_of_2(R)) if has_lora else 16
    if silu:
        gu = gate_up
        w2 = gu["packed"].view(torch.int32)
        s2 = gu["scale"].view(torch.uint8)
        gs2 = gu.get("global_scale") if gu.get("global_scale") is not None else dummy
        b2 = gu.get("bias") if gu.get("bias") is not None else dummy
        xa2 = gu.get("lora_xa") if has_lora else dummy
        lb2 = gu.get("lora_b") if has_lora else dummy
        if (bias is None) != (gu.get("bias") is None):
            raise ValueError("gate/up must both have or both lack a bias")
        if has_lora and (gu.get("lora_xa") is None or gu["lora_xa"].shape[1] != R):
            raise ValueError("gate/up LoRA must have the same rank layout")
    else:
        w2 = s2 = gs2 = b2 = xa2 = lb2 = dummy
    key = (cfg, silu, fc, x_permuted, out_permuted, has_lora, bias is not None)
    if key in _FAILED_CONFIGS:  # use the fallback tiles, keeping split-K for parallelism
        tiles = triton_cdiv(M, SAFE_CONFIG.BM) * triton_cdiv(N, SAFE_CONFIG.BN)
        split = split_k_for(tiles, K, SAFE_CONFIG.BKW, 264)
        if (cfg, "safe-split") in _FAILED_CONFIGS:
            split = 1
        cfg = dataclasses.replace(SAFE_CONFIG, SPLIT_K=split)
        BKW = max(cfg.BKW, GW)
        per_split = triton_cdiv(triton_cdiv(KW, split), BKW) * BKW
        split = triton_cdiv(KW, per_split)
        if split > 1:
            ws, cnt = _workspace(x.device, (2 if silu else 1) * split * M * N, tiles)
    try:
        _fp4_mm_kernel[(tiles, split)](
            x, x.stride(0), wq, wq.stride(0), sq, sq.stride(0), gs,
            bias if bias is not None else dummy,
            w2, s2, gs2, b2,
            lora_xa if has_lora else dummy, lora_xa.stride(0) if has_lora else 0,
            lora_b if has_lora else dummy, lora_b.stride(0) if has_lora else 0,
            xa2, lb2, R,
            out, out.stride(0), ws, cnt,
            M, N, KW, NG, per_split,
            FMT=fc, GW=GW, USE_ASM=use_asm, PERM_X=x_permuted, PERM_OUT=out_permuted, SILU=silu,
            HAS_BIAS=bias is not None, HAS_LORA=has_lora, RP=RP, SPLIT_K=split,
            BM=cfg.BM, BN=cfg.BN, BKW=max(cfg.BKW, GW), SWAP=cfg.SWAP,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        if split > 1:
            _fp4_splitk_finish_kernel[(tiles,)](
                ws, gs, bias if bias is not None else dummy, gs2, b2,
                lora_xa if has_lora else dummy, lora_xa.stride(0) if has_lora else 0,
                lora_b if has_lora else dummy, lora_b.stride(0) if has_lora else 0,
                xa2, lb2, R, out, out.stride(0), M, N,
                FMT=fc, PERM_OUT=out_permuted, SILU=silu, HAS_BIAS=bias is not None,
                HAS_LORA=has_lora, RP=RP, SPLIT_K=split, BM=cfg.BM, BN=cfg.BN,
                num_warps=4 if cfg.BM * cfg.BN <= 4096 else 8,
            )
    except Exception as e:  # a tile configuration the compiler rejects: fall back, remember
        if cfg == SAFE_CONFIG:
            raise
        if key in _FAILED_CONFIGS:  # the fallback with split-K failed too: last try, no split
            if (key[0], "safe-split") in _FAILED_CONFIGS or cfg.SPLIT_K == 1:
                raise
            _FAILED_CONFIGS.add((key[0], "safe-split"))
            return fp4_linear_triton(x, packed, scale, fmt, global_scale, bias, lora_xa=lora_xa,
                                     lora_b=lora_b, gate_up=gate_up, x_permuted=x_permuted,
                                     out_permuted=out_permuted, out=out, config=key[0],
                                     use_asm=use_asm)
        import warnings

        warnings.warn(f"fp4 kernel config {cfg} failed to compile ({type(e).__name__}); "
                      f"falling back to {SAFE_CONFIG}", stacklevel=2)
        _FAILED_CONFIGS.add(key)
        return fp4_linear_triton(x, packed, scale, fmt, global_scale, bias, lora_xa=lora_xa,
                                 lora_b=lora_b, gate_up=gate_up, x_permuted=x_permuted,
                                 out_permuted=out_permuted, out=out, config=cfg, use_asm=use_asm)
    return out


def fp4_dequantize_triton(
    packed: torch.Tensor,
    scale: torch.Tensor,
    fmt: str,
    global_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.bfloat16,
    use_asm: bool | None = None,
) -> torch.Tensor:
    """Dequantize on the GPU to ``[out, in]`` (natural column order), for large-M prefill GEMMs."""
    use_asm = USE_ASM_DEFAULT if use_asm is None else use_asm
    N, KB = packed.shape
    K = KB * 2
    GW = GROUP_SIZE[fmt] // 8
    if out is None:
        out = torch.empty((N, K), dtype=dtype, device=packed.device)
    wq = packed.view(torch.int32)
    sq = scale.view(torch.uint8)
    BN, BKW = 32, 32
    gs = global_scale if global_scale is not None else out
    grid = (triton_cdiv(N, BN), triton_cdiv(K // 8, BKW))
    _fp4_dequant_kernel[grid](
        wq, wq.stride(0), sq, sq.stride(0), gs, out, out.stride(0), N, K // 8,
        K // GROUP_SIZE[fmt], FMT=_fmt_code(fmt), GW=GW, USE_ASM=use_asm, BN=BN, BKW=BKW,
        num_warps=4,
    )
    return out


def fp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, fmt: str,
               global_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               **kw) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for packed FP4 ``W``: Triton on CUDA, the torch reference elsewhere.

    Accepts any leading shape of ``x``. Keyword arguments as in :func:`fp4_linear_triton`.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.is_cuda and HAS_TRITON and x2.dtype in (torch.bfloat16,):
        y = fp4_linear_triton(x2, packed, scale, fmt, global_scale, bias, **kw)
    else:
        kw.pop("config", None)
        kw.pop("use_asm", None)
        out = kw.pop("out", None)
        y = fp4_linear_reference(x2, packed, scale, fmt, global_scale, bias, **kw)
        if out is not None:
            out.copy_(y)
            y = out
    return y.reshape(*lead, y.shape[-1])


def fp4_self_check(device="cuda") -> dict:
    """Quick GPU check of the asm decode against the pure-Triton decode and the reference."""
    torch.manual_seed(0)
    res = {}
    for fmt in FP4_FORMATS:
        w = torch.randn(96, 256, device=device)
        q = quantize_fp4(w, fmt)
        x = torch.randn(5, 256, device=device, dtype=torch.bfloat16)
        ref = fp4_linear_reference(x, q["weight_packed"], q["weight_scale"], fmt,
                                   q.get("weight_global_scale"), out_dtype=torch.float32)
        for asm in (False, True):
            y = fp4_linear_triton(x, q["weight_packed"], q["weight_scale"], fmt,
                                  q.get("weight_global_scale"), use_asm=asm).float()
            res[(fmt, asm)] = float((y - ref).norm() / ref.norm())
    return res


__all__ = [
    "FP4_FORMATS", "GROUP_SIZE", "HAS_TRITON", "Fp4Config", "CONFIG_TABLE", "PERMUTED_X_DEFAULT",
    "USE_ASM_DEFAULT", "e2m1_table", "unpack_e2m1", "unpack_e2m1_codes", "pack_e2m1",
    "decode_scale", "dequantize_fp4", "quantize_fp4", "permute_activation", "unpermute_activation",
    "fp4_linear_reference", "fp4_linear_triton", "fp4_dequantize_triton", "fp4_linear",
    "pick_config", "split_k_for", "load_tuning", "reserve_workspace", "fp4_self_check",
]
