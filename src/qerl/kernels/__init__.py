"""GPU kernels (Triton) with plain-torch references: weight-only FP4 matmul (NVFP4 / MXFP4)."""

from qerl.kernels.fp4_matmul import (
    FP4_FORMATS,
    GROUP_SIZE,
    HAS_TRITON,
    dequantize_fp4,
    fp4_dequantize_triton,
    fp4_linear,
    fp4_linear_reference,
    fp4_linear_triton,
    permute_activation,
    quantize_fp4,
    unpermute_activation,
)

__all__ = [
    "FP4_FORMATS",
    "GROUP_SIZE",
    "HAS_TRITON",
    "dequantize_fp4",
    "fp4_dequantize_triton",
    "fp4_linear",
    "fp4_linear_reference",
    "fp4_linear_triton",
    "permute_activation",
    "quantize_fp4",
    "unpermute_activation",
]
