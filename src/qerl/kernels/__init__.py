"""4-bit (NVFP4 / MXFP4) matmuls on the GPU: backend selection, the training autograd path, the
Triton dequantize kernel, humming-kernels as the decode GEMM and our FP4 GEMV for decode at a few
rows (:mod:`qerl.kernels.fp4_gemv`; it runs on CUDA, compiled by NVRTC).

Backend API (see :mod:`qerl.kernels.backend`): ``resolve_backend(name="auto") -> str``,
``use_backend(name)`` (what the ``quant.backend`` setting calls), ``available_backends()``,
``FP4_BACKENDS``; the ``QERL_FP4_BACKEND`` environment variable forces one. The layer-level entry
is :func:`fp4_linear` (what ``QuantLinear.forward`` calls).
"""

from qerl.kernels.backend import (
    FP4_BACKENDS,
    available_backends,
    backend_available,
    humming_max_m,
    resolve_backend,
    use_backend,
)
from qerl.kernels.dequant import HAS_TRITON, dequantize_into, reserve_scratch, scratch
from qerl.kernels.fp4_linear import (
    Fp4LinearFunction,
    KernelCache,
    dequantized_weight,
    fp4_linear,
    humming_gemm_of,
)

__all__ = [
    "FP4_BACKENDS",
    "HAS_TRITON",
    "Fp4LinearFunction",
    "KernelCache",
    "available_backends",
    "backend_available",
    "dequantize_into",
    "dequantized_weight",
    "fp4_linear",
    "humming_gemm_of",
    "humming_max_m",
    "reserve_scratch",
    "resolve_backend",
    "scratch",
    "use_backend",
]
