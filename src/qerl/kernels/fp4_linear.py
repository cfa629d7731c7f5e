"""``y = x @ W^T + b`` for a frozen FP4 layer: the dispatch and the memory-lean autograd function.

Dispatch (per call, on the input's device and row count ``M`` = all leading dims flattened):

* CPU (any non-CUDA device), or backend ``torch``: dequantize with the torch codec, ``F.linear``;
* CUDA, backend ``humming``, ``M <= humming_max_m()``, bf16/fp16 input: one humming GEMM on the
  layer's humming tensors (prepared on the first such call and cached on the layer; rebuilt when
  a buffer is replaced, moved or modified in place);
* otherwise on CUDA (backend ``triton``, or humming above the threshold): the Triton kernel
  dequantizes the layer into the shared scratch (:mod:`qerl.kernels.dequant`), then cuBLAS.

Autograd (:class:`Fp4LinearFunction`): forward saves nothing but a reference to the layer; the
x-gradient dequantizes the weight again (into the scratch on CUDA) and computes ``grad_y @ W``.
No dequantized weight is kept for backward, so activation checkpointing bounds memory to the
checkpointed activations plus one scratch of the largest layer. The weight never gets a gradient
(it is frozen); a bias that requires grad gets ``grad_y`` summed over rows.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from qerl.kernels import dequant
from qerl.kernels.backend import humming_max_m, resolve_backend

__all__ = ["Fp4LinearFunction", "KernelCache", "dequantized_weight", "fp4_linear", "humming_gemm_of"]


class KernelCache:
    """Per-layer cache of prepared kernel tensors (humming's), dropped by copies and pickles.

    ``get(key, signature, build)`` returns the cached object for ``key`` if it was built for the
    same ``signature`` (the layer buffers' storage, version counter and device), else builds it.
    """

    def __init__(self) -> None:
        self._items: dict[object, tuple[tuple, object]] = {}

    def get(self, key: object, signature: tuple, build):
        hit = self._items.get(key)
        if hit is not None and hit[0] == signature:
            return hit[1]
        self._items.pop(key, None)  # free the stale copy before building a new one
        obj = build()
        self._items[key] = (signature, obj)
        return obj

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __deepcopy__(self, memo) -> KernelCache:
        return KernelCache()

    def __getstate__(self) -> dict:
        return {"_items": {}}


def _tensors(layer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    return layer.weight_packed, layer.weight_scale, getattr(layer, "weight_global_scale", None)


def _signature(layer) -> tuple:
    ts = [t for t in (*_tensors(layer), layer.bias) if t is not None]
    return tuple((t.data_ptr(), t._version, str(t.device)) for t in ts)


def humming_gemm_of(layer, dtype: torch.dtype):
    """The layer's humming GEMM for ``dtype`` (built once, cached on the layer)."""
    from qerl.kernels.humming_gemm import HummingFp4

    def build():
        bias = None if layer.bias is None else layer.bias.detach()
        return HummingFp4(layer.fmt, [_tensors(layer)], bias=bias, dtype=dtype)

    return layer.kernel_cache.get(("humming", dtype), _signature(layer), build)


def _humming_or_none(layer, dtype: torch.dtype):
    """The layer's humming GEMM, or ``None`` (with one warning per layer) if humming cannot
    prepare it; the caller then takes the dequantize path."""
    try:
        return humming_gemm_of(layer, dtype)
    except Exception as e:  # noqa: BLE001 - degrade to the dequantize path, loudly
        if not getattr(layer, "_humming_warned", False):
            warnings.warn(f"humming could not prepare a {layer.fmt} layer "
                          f"[{layer.out_features}, {layer.in_features}] ({type(e).__name__}: "
                          f"{e}); using the Triton dequantize + cuBLAS path", stacklevel=3)
            layer._humming_warned = True
        layer.kernel_cache.get(("humming", dtype), _signature(layer), lambda: None)  # not again
        return None


def dequantized_weight(layer, dtype: torch.dtype, device: torch.device,
                       backend: str | None = None) -> torch.Tensor:
    """The layer's weight ``[out, in]`` in ``dtype``: a view of the shared scratch on CUDA with
    Triton (valid until the next dequantization on this device), a fresh tensor otherwise."""
    packed, scale, gscale = _tensors(layer)
    backend = backend or (resolve_backend() if device.type == "cuda" else "torch")
    if device.type == "cuda" and backend != "torch" and dequant.HAS_TRITON:
        out = dequant.scratch(device, dtype, layer.out_features, layer.in_features)
        return dequant.dequantize_into(out, layer.fmt, packed, scale, gscale, impl="triton")
    return layer.dequantize(dtype)


def _bias(layer, dtype: torch.dtype) -> torch.Tensor | None:
    return None if layer.bias is None else layer.bias.to(dtype)


def _forward(x: torch.Tensor, layer) -> torch.Tensor:
    """The forward computation (no autograd), routed as in the module docstring."""
    if x.device.type != "cuda":
        return F.linear(x, layer.dequantize(x.dtype), _bias(layer, x.dtype))
    backend = resolve_backend()
    rows = x.numel() // max(1, x.shape[-1])
    if backend == "humming" and 0 < rows <= humming_max_m() \
            and x.dtype in (torch.bfloat16, torch.float16):
        gemm = _humming_or_none(layer, x.dtype)
        if gemm is not None:
            x2 = x.reshape(rows, x.shape[-1])
            y = gemm(x2 if x2.is_contiguous() else x2.contiguous())
            return y.reshape(*x.shape[:-1], layer.out_features)
    w = dequantized_weight(layer, x.dtype, x.device, backend)
    return F.linear(x, w, _bias(layer, x.dtype))


class Fp4LinearFunction(torch.autograd.Function):
    """Autograd for ``y = x W^T + b`` with a frozen FP4 ``W`` that saves no weight (see above).

    ``apply(x, bias, layer)``: ``bias`` is ``layer.bias`` (or ``None``), passed as an input so
    that it gets a gradient when it requires one.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, bias: torch.Tensor | None, layer) -> torch.Tensor:  # type: ignore[override]
        ctx.layer = layer
        return _forward(x, layer)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):  # type: ignore[override]
        layer = ctx.layer
        grad_x = grad_b = None
        if ctx.needs_input_grad[0]:
            w = dequantized_weight(layer, grad_y.dtype, grad_y.device)
            grad_x = grad_y @ w
        if ctx.needs_input_grad[1]:
            grad_b = grad_y.reshape(-1, grad_y.shape[-1]).sum(0).to(layer.bias.dtype)
        return grad_x, grad_b, None


def fp4_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """``x @ W^T + b`` for a ``QuantLinear``-like ``layer`` (``fmt``, ``weight_packed``,
    ``weight_scale``, optional ``weight_global_scale``, ``bias``, ``kernel_cache``,
    ``dequantize``), differentiable in ``x`` (and in a bias that requires grad); under autocast
    ``x`` is cast to the autocast dtype first."""
    dev = x.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        with torch.autocast(dev, enabled=False):
            return fp4_linear(x.to(torch.get_autocast_dtype(dev)), layer)
    bias = layer.bias
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return Fp4LinearFunction.apply(x, bias, layer)
    return _forward(x, layer)
