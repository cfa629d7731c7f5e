"""Weight-only FP4 formats of our own: NVFP4 and MXFP4, both with FP4 E2M1 elements.

Element format (shared): FP4 E2M1. A 4-bit code's bit 3 is the sign and bits 0-2 index the
magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6``. Encoding rounds to the nearest magnitude, ties to the
even code (the E2M1 mantissa bit 0), and saturates at 6. The sign bit follows the input's sign
bit, so a small negative value that rounds to zero is stored as ``-0`` (code 8), the same as the
bit-level casts in torchao.

Packing (shared): two codes per byte, ``uint8 [out, in/2]``; element ``2j`` is in the LOW nibble
and element ``2j+1`` in the HIGH nibble.

NVFP4 (compressed-tensors 0.20 "nvfp4-pack-quantized" layout, weight-only "NVFP4A16"):

- ``weight_packed`` uint8 ``[out, in/2]``;
- ``weight_scale`` float8_e4m3fn ``[out, in/16]``, one per 16 elements;
- ``weight_global_scale`` float32 ``[1]``, stored INVERTED: ``448 * 6 / amax(|W|)``.

  ``W ~= e2m1(code) * weight_scale.float() / weight_global_scale``. A block scale is
  ``amax(block) / 6 * global``, saturated to 448 and cast to E4M3 (round to nearest even). It is
  clamped below at the smallest normal E4M3 value (2^-6), as torchao does, so that scales are
  never zero or subnormal (an all-zero block then simply stores zero codes). Elements are
  ``x / (weight_scale / global)`` rounded to E2M1. Against torchao's ``NVFP4Tensor.to_nvfp4`` with
  ``per_tensor_scale = amax / 2688``: codes and scales agree; dequantized values agree to one
  float32 rounding (torchao multiplies by amax/2688, we divide by 2688/amax). With bf16 inputs a
  block scale can land exactly on an E4M3 rounding tie, and the two orders of operations may then
  pick different neighbours (about 1% of blocks; same error overall).

MXFP4 (OCP Microscaling v1.0, compressed-tensors "mxfp4-pack-quantized"):

- ``weight_packed`` uint8 ``[out, in/2]``;
- ``weight_scale`` uint8 E8M0 ``[out, in/32]``: value ``2^(e - 127)``, 255 is NaN. No global scale.

  The shared exponent is ``floor(log2(amax(block))) - 2`` (2 = exponent of E2M1's largest power of
  two), clamped to the E8M0 range; elements ``x / 2^e`` are rounded to E2M1 and saturate at 6.
  This is the "FLOOR" mode of torchao's ``MXTensor.to_mx``, and dequantized values equal torchao's
  bit for bit. One deliberate difference: a block whose amax is below 2^-124 (scale code 0) is
  quantized with the scale it is dequantized with (2^-127); torchao quantizes it with 2^-126.

All functions are vectorised torch and run on any device; inputs may be any floating dtype (the
math is done in float32). The quantizers accept ``[..., K]`` tensors with ``K`` a multiple of the
block size, are deterministic, and work through whole rows in chunks of about
``CHUNK_ELEMENTS`` elements so their temporary memory stays bounded for any layer size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache

import torch

__all__ = [
    "E2M1_MAGNITUDES",
    "E2M1_MAX",
    "E4M3_MAX",
    "FORMATS",
    "FP4_FORMATS",
    "QUANT_FORMATS",
    "Fp4Format",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "e2m1_decode",
    "e2m1_encode",
    "e8m0_to_float",
    "get_format",
    "pack_fp4",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "unpack_fp4",
]

#: Every ``quant.format``: the bf16/fp32 baseline, bitsandbytes' two, ours (the one list of them).
QUANT_FORMATS: tuple[str, ...] = ("none", "nf4", "fp4", "nvfp4", "mxfp4")
FP4_FORMATS: tuple[str, ...] = ("nvfp4", "mxfp4")  # implemented here, in the compressed-tensors layout

E2M1_MAGNITUDES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0**-6
E2M1_EMAX = 2  # exponent of the largest power of two in E2M1 (4 = 2^2)
E8M0_BIAS = 127
E8M0_NAN = 255

# Midpoints between neighbouring magnitudes. A value exactly on a midpoint goes to the neighbour
# with the even code: down for codes (0|1), (2|3), (4|5), (6|7); up for (1|2), (3|4), (5|6).
_MIDPOINTS: tuple[float, ...] = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP: tuple[float, ...] = (0.75, 1.75, 3.5)

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32

# --------------------------------------------------------------------------- E2M1 elements


@lru_cache(maxsize=16)
def _device_constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(midpoints, ties-up midpoints, 16-entry decode table) as float32 tensors on ``device``."""
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=device)
    ties_up = torch.tensor(_TIES_UP, dtype=torch.float32, device=device)
    signed = list(E2M1_MAGNITUDES) + [-m for m in E2M1_MAGNITUDES]
    table = torch.tensor(signed, dtype=torch.float32, device=device)
    return mids, ties_up, table


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to FP4 E2M1 codes (uint8 in [0, 15], same shape).

    Round to nearest, ties to even, saturating at +-6; the sign bit is the input's sign bit.
    """
    x32 = x.float()
    mids, ties_up, _ = _device_constants(x32.device)
    mag = x32.abs()
    # bucketize(right=False) counts the midpoints strictly below |x|: ties round down ...
    code = torch.bucketize(mag, mids, right=False, out_int32=True)
    # ... except on the midpoints whose upper neighbour has the even code.
    code += torch.isin(mag, ties_up)
    del mag
    code = code.to(torch.uint8)
    code |= torch.signbit(x32).to(torch.uint8) << 3
    return code


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """FP4 E2M1 codes (integer tensor, values 0-15) to float32 values, same shape."""
    _, _, table = _device_constants(codes.device)
    return table[codes.int()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., K]`` (K even) into uint8 ``[..., K/2]``.

    Element ``2j`` goes to the low nibble of byte ``j``, element ``2j+1`` to its high nibble.
    """
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}")
    c = codes.to(torch.uint8) & 0x0F
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp4`: uint8 ``[..., K/2]`` to codes uint8 ``[..., K]``."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_fp4 needs uint8 input, got {packed.dtype}")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


# --------------------------------------------------------------------------- helpers


# Quantizers work on at most this many elements at a time (in whole rows), which bounds their
# temporary memory to a few hundred MB on the device whatever the layer size.
CHUNK_ELEMENTS = 1 << 24


def _check_weight(w: torch.Tensor, block: int, fmt: str) -> None:
    """Check that ``w`` is a finite float tensor whose last dimension is whole blocks."""
    if not w.is_floating_point():
        raise TypeError(f"{fmt}: expected a floating-point weight, got {w.dtype}")
    if w.ndim < 1 or w.shape[-1] % block != 0:
        raise ValueError(
            f"{fmt}: the last dimension must be a multiple of the block size {block}, "
            f"got shape {tuple(w.shape)}"
        )
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{fmt}: weight contains NaN or Inf values; refusing to quantize it")


def _quantize_rows(
    w: torch.Tensor,
    block: int,
    rows_fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply ``rows_fn`` (float32 blocks ``[rows, K/block, block]`` -> (packed, scales)) to
    chunks of whole rows of ``w [..., K]``; return ``packed [..., K/2]`` and ``scales
    [..., K/block]``. Rows are independent, so chunking never changes the result."""
    k = w.shape[-1]
    rows = w.detach().reshape(-1, k)
    step = max(1, CHUNK_ELEMENTS // k)
    packed, scales = [], []
    for chunk in rows.split(step, dim=0):
        p, s = rows_fn(chunk.float().reshape(chunk.shape[0], k // block, block))
        packed.append(p)
        scales.append(s)
    lead = tuple(w.shape[:-1])
    packed_all = torch.cat(packed) if len(packed) > 1 else packed[0]
    scales_all = torch.cat(scales) if len(scales) > 1 else scales[0]
    return packed_all.reshape(*lead, k // 2), scales_all.reshape(*lead, k // block)


def _check_packed(packed: torch.Tensor, scale: torch.Tensor, block: int, fmt: str) -> int:
    """Check that packed codes and block scales fit together; return the unpacked K."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"{fmt}: weight_packed must be uint8, got {packed.dtype}")
    k = packed.shape[-1] * 2
    if tuple(scale.shape) != (*packed.shape[:-1], k // block) or k % block != 0:
        raise ValueError(
            f"{fmt}: weight_scale shape {tuple(scale.shape)} does not match weight_packed shape "
            f"{tuple(packed.shape)} with blocks of {block}"
        )
    return k


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 scale codes (uint8) to float32 ``2^(s - 127)``, exactly; 255 is NaN."""
    s = scale.to(torch.int32)
    # Biased exponent s >= 1 is the float32 bit pattern s << 23; s == 0 is the subnormal 2^-127.
    value = torch.bitwise_left_shift(s, 23).view(torch.float32)
    value = torch.where(s == 0, torch.full_like(value, 2.0**-127), value)
    return torch.where(s == E8M0_NAN, torch.full_like(value, float("nan")), value)


# --------------------------------------------------------------------------- NVFP4


def quantize_nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize ``w [..., K]`` (K % 16 == 0) to NVFP4 in the compressed-tensors layout.

    Returns ``weight_packed`` (uint8 ``[..., K/2]``), ``weight_scale`` (float8_e4m3fn
    ``[..., K/16]``) and ``weight_global_scale`` (float32 ``[1]``, = 448*6/amax, inverted).
    """
    _check_weight(w, NVFP4_BLOCK, "nvfp4")
    amax = w.detach().abs().amax().float()
    finfo = torch.finfo(torch.float32)
    global_scale = torch.where(amax > 0, (E4M3_MAX * E2M1_MAX) / amax, torch.ones_like(amax))
    global_scale = global_scale.clamp(max=finfo.max)

    def rows_fn(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block_amax = blocks.abs().amax(dim=-1)
        scale = (block_amax / E2M1_MAX * global_scale).clamp(min=E4M3_MIN_NORMAL, max=E4M3_MAX)
        scale = scale.to(torch.float8_e4m3fn)
        effective = scale.float() / global_scale
        codes = e2m1_encode(blocks / effective.unsqueeze(-1)).flatten(-2)
        return pack_fp4(codes), scale

    packed, scale = _quantize_rows(w, NVFP4_BLOCK, rows_fn)
    return {
        "weight_packed": packed,
        "weight_scale": scale,
        "weight_global_scale": global_scale.reshape(1).to(torch.float32),
    }


def dequantize_nvfp4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_global_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """NVFP4 tensors back to ``dtype``: ``e2m1(code) * weight_scale / weight_global_scale``.

    The product is formed in float32 and cast once to ``dtype``.
    """
    k = _check_packed(weight_packed, weight_scale, NVFP4_BLOCK, "nvfp4")
    values = e2m1_decode(unpack_fp4(weight_packed))
    values = values.reshape(*values.shape[:-1], k // NVFP4_BLOCK, NVFP4_BLOCK)
    block = weight_scale.float() / weight_global_scale.float().reshape(())
    return (values * block.unsqueeze(-1)).flatten(-2).to(dtype)


# --------------------------------------------------------------------------- MXFP4


def quantize_mxfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Quantize ``w [..., K]`` (K % 32 == 0) to MXFP4.

    Returns ``weight_packed`` (uint8 ``[..., K/2]``) and ``weight_scale`` (uint8 E8M0
    ``[..., K/32]``).
    """
    _check_weight(w, MXFP4_BLOCK, "mxfp4")

    def rows_fn(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block_amax = blocks.abs().amax(dim=-1)
        # frexp: amax = m * 2^p, m in [0.5, 1), so floor(log2(amax)) = p - 1 (exact, subnormals too)
        _, p = torch.frexp(block_amax)
        exponent = p.to(torch.int32) - 1 - E2M1_EMAX
        exponent = torch.where(block_amax > 0, exponent, torch.full_like(exponent, -E8M0_BIAS))
        exponent = exponent.clamp(min=-E8M0_BIAS, max=E8M0_BIAS)
        scale = (exponent + E8M0_BIAS).to(torch.uint8)
        codes = e2m1_encode(blocks / e8m0_to_float(scale).unsqueeze(-1)).flatten(-2)
        return pack_fp4(codes), scale

    packed, scale = _quantize_rows(w, MXFP4_BLOCK, rows_fn)
    return {"weight_packed": packed, "weight_scale": scale}


def dequantize_mxfp4(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """MXFP4 tensors back to ``dtype``: ``e2m1(code) * 2^(weight_scale - 127)``."""
    k = _check_packed(weight_packed, weight_scale, MXFP4_BLOCK, "mxfp4")
    if weight_scale.dtype != torch.uint8:
        raise TypeError(f"mxfp4: weight_scale must be uint8 (E8M0), got {weight_scale.dtype}")
    values = e2m1_decode(unpack_fp4(weight_packed))
    values = values.reshape(*values.shape[:-1], k // MXFP4_BLOCK, MXFP4_BLOCK)
    return (values * e8m0_to_float(weight_scale).unsqueeze(-1)).flatten(-2).to(dtype)


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Fp4Format:
    """One of our FP4 weight formats: its layout, codec and storage accounting.

    Attributes:
        name / block_size / scale_dtype: "nvfp4" or "mxfp4", elements per block scale, its dtype.
        tensor_names: buffer names, in the order ``dequantize_fn`` takes them.
        ct_format / ct_strategy: the compressed-tensors ``format`` and weight ``strategy``.
        quantize_fn / dequantize_fn: ``w -> {name: tensor}`` / ``(*tensors, dtype=...) -> w``.
    """

    name: str
    block_size: int
    scale_dtype: torch.dtype
    tensor_names: tuple[str, ...]
    ct_format: str
    ct_strategy: str
    quantize_fn: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    dequantize_fn: Callable[..., torch.Tensor]

    @property
    def has_global_scale(self) -> bool:
        """Whether the format stores a per-tensor ``weight_global_scale``."""
        return "weight_global_scale" in self.tensor_names

    def quantize(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Quantize a weight ``[out, in]`` into this format's tensors."""
        return self.quantize_fn(w)

    def dequantize(
        self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Dequantize this format's tensors (a mapping by buffer name) to ``dtype``."""
        return self.dequantize_fn(*(tensors[n] for n in self.tensor_names), dtype=dtype)

    def divides(self, in_features: int) -> bool:
        """Whether a layer with this many input features can be stored in this format."""
        return in_features % self.block_size == 0

    def tensor_specs(
        self, out_features: int, in_features: int
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each stored tensor for a ``[out, in]`` weight."""
        specs = {
            "weight_packed": ((out_features, in_features // 2), torch.uint8),
            "weight_scale": ((out_features, in_features // self.block_size), self.scale_dtype),
        }
        if self.has_global_scale:
            specs["weight_global_scale"] = ((1,), torch.float32)
        return specs

    def storage_bytes(self, out_features: int, in_features: int) -> int:
        """Bytes stored for a ``[out, in]`` weight: packed codes + block scales + global scale."""
        total = 0
        for shape, dtype in self.tensor_specs(out_features, in_features).values():
            n = 1
            for d in shape:
                n *= d
            total += n * dtype.itemsize
        return total

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        """Stored bits per weight element (4 + 8/block, plus the global scale's share)."""
        return 8.0 * self.storage_bytes(out_features, in_features) / (out_features * in_features)


FORMATS: dict[str, Fp4Format] = {
    "nvfp4": Fp4Format(
        name="nvfp4",
        block_size=NVFP4_BLOCK,
        scale_dtype=torch.float8_e4m3fn,
        tensor_names=("weight_packed", "weight_scale", "weight_global_scale"),
        ct_format="nvfp4-pack-quantized",
        ct_strategy="tensor_group",
        quantize_fn=quantize_nvfp4,
        dequantize_fn=dequantize_nvfp4,
    ),
    "mxfp4": Fp4Format(
        name="mxfp4",
        block_size=MXFP4_BLOCK,
        scale_dtype=torch.uint8,
        tensor_names=("weight_packed", "weight_scale"),
        ct_format="mxfp4-pack-quantized",
        ct_strategy="group",
        quantize_fn=quantize_mxfp4,
        dequantize_fn=dequantize_mxfp4,
    ),
}


def get_format(name: str) -> Fp4Format:
    """Look up a format by name; ``KeyError`` lists the known ones."""
    if name not in FORMATS:
        raise KeyError(f"unknown FP4 format {name!r}; known: {sorted(FORMATS)}")
    return FORMATS[name]
