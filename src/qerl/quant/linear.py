"""``QuantLinear``: a frozen, weight-only 4-bit linear layer (NVFP4 or MXFP4), and model helpers.

Storage. The layer holds the format's tensors as persistent buffers under exactly the
compressed-tensors names (``weight_packed``, ``weight_scale`` and, for NVFP4,
``weight_global_scale``) plus an optional frozen ``bias`` parameter, so ``state_dict()`` of a
quantized model IS the compressed-tensors checkpoint layout (``<prefix>.weight_packed`` ...).
``.to(dtype)`` / ``.half()`` / ``.bfloat16()`` on the model never cast those buffers (the E4M3
scales and the float32 global scale would lose information); device moves work as usual.

Forward is ``y = x @ W^T + b`` with ``W`` the dequantized weight, through
:func:`qerl.kernels.fp4_linear`: on CPU the torch codec dequantizes and ``F.linear`` multiplies;
on CUDA the selected backend runs it (humming-kernels for decode-sized inputs, else the Triton
dequantize kernel into a shared scratch + cuBLAS; ``qerl.kernels.resolve_backend``). Under
autograd the weight is never saved for backward: the x-gradient dequantizes it again. Kernel
tensors prepared for a backend (humming's layout) live in ``kernel_cache``, are built on first
use and rebuilt when a buffer changes; :func:`reference_fp4_matmul` is the plain reference.

PEFT integration (why ``QuantLinear`` subclasses ``nn.Linear`` with ``weight = None`` and a
``qweight`` property). Stock peft must wrap it with no custom registration, so that
``LoraConfig(target_modules=[...])`` + ``get_peft_model`` and ``PeftModel.from_pretrained`` work
unchanged. In peft 0.21.2:

- ``LoraModel._create_new_module`` tries the backend dispatchers in order and ends with
  ``dispatch_default``, which wraps anything that ``isinstance(..., nn.Linear)`` in
  ``lora.Linear``. ``lora.Linear.forward`` calls ``base_layer(x)`` and adds the adapter path; it
  never reads the base weight. The earlier dispatchers (bnb, gptq, torchao, ...) match on their own
  classes or tensor types and ignore us. Subclassing ``nn.Linear`` is therefore all the dispatch
  needs. The alternative, ``LoraConfig._register_custom_module``, is private, is not serialised with
  the adapter config and would have to be repeated before every ``PeftModel.from_pretrained``.
- ``_get_in_out_features`` reads ``in_features`` / ``out_features`` (and inspects ``.weight`` for
  DTensor sharding, which ``None`` passes).
- ``LoraModel._replace_module`` and ``_move_adapter_to_device_of_base_layer`` place the new
  adapter on the base layer's device by looking at ``qweight`` first, then ``weight`` (the GPTQ
  convention). ``qweight`` is a read-only alias of ``weight_packed`` (not a second buffer, so not
  in the state dict). Its dtype is uint8, so peft leaves the adapter dtype alone (float32 LoRA
  weights, the stable choice for training).
- ``weight`` is registered as ``None`` (like ``bias`` in a bias-free ``nn.Linear``): code that
  assumes a float weight (``merge_and_unload``, transformers' weight init) fails loudly instead of
  silently writing into packed codes. Merging an adapter into a 4-bit base is lossy anyway: keep
  the adapter separate (and sync only the adapter to rollout engines).

Only exact ``nn.Linear`` modules are replaced by :func:`quantize_model_` (not subclasses such as
``MultiheadAttention``'s ``out_proj``, whose owners read ``.weight`` directly).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from qerl.errors import QerlConfigError
from qerl.kernels.fp4_linear import KernelCache, fp4_linear
from qerl.quant.formats import FORMATS, Fp4Format

__all__ = [
    "QuantLinear",
    "QuantizeSummary",
    "check_on_indivisible",
    "indivisible_error",
    "module_matches",
    "plan_quantization",
    "quantize_model_",
    "reference_fp4_matmul",
    "set_submodule",
]

OnIndivisible = Literal["skip", "error"]

# Same-width integer dtypes used to hide float-typed quantization buffers from dtype casts.
_INT_TWIN: dict[torch.dtype, torch.dtype] = {
    torch.float8_e4m3fn: torch.uint8,
    torch.float32: torch.int32,
}


# --------------------------------------------------------------------------- matmul backends


def reference_fp4_matmul(x: torch.Tensor, layer: QuantLinear) -> torch.Tensor:
    """Reference: dequantize to ``x.dtype`` with the torch codec and call ``F.linear``."""
    weight = layer.dequantize(x.dtype)
    bias = None if layer.bias is None else layer.bias.to(x.dtype)
    return F.linear(x, weight, bias)


# --------------------------------------------------------------------------- the layer


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for a view a tensor on the same storage that is not a view (no ``_base``):
    a buffer whose storage is swapped (``.data = ...``, as the rollout engine's host parking does)
    then really releases the old storage instead of a hidden base keeping it alive."""
    if t._base is None:
        return t
    out = torch.empty(0, dtype=t.dtype, device=t.device)
    return out.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


class QuantLinear(nn.Linear):
    """Frozen weight-only FP4 linear layer (see the module docstring for the design).

    Args:
        in_features: input size; a multiple of the format's block size.
        out_features: output size.
        bias: whether the layer has a (frozen) bias.
        fmt: "nvfp4" or "mxfp4".
        device: where the (zero-filled) buffers are created; "meta" makes an empty shell.
        dtype: dtype of the bias.
    """

    weight_packed: torch.Tensor
    weight_scale: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        fmt: str = "nvfp4",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        nn.Module.__init__(self)
        spec = _format(fmt)
        if not spec.divides(in_features):
            raise ValueError(
                f"{fmt}: in_features={in_features} is not a multiple of the block size "
                f"{spec.block_size}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        self.register_parameter("weight", None)
        self.kernel_cache = KernelCache()
        for name, (shape, tdtype) in spec.tensor_specs(out_features, in_features).items():
            self.register_buffer(name, torch.zeros(shape, dtype=tdtype, device=device))
        if bias:
            b = torch.zeros(out_features, dtype=dtype, device=device)
            self.bias = nn.Parameter(b, requires_grad=False)
        else:
            self.register_parameter("bias", None)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_weight(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        fmt: str,
        device: torch.device | str | None = None,
    ) -> QuantLinear:
        """Quantize a float ``weight [out, in]`` on ``device`` (default: where it is)."""
        out_features, in_features = weight.shape
        target = torch.device(device) if device is not None else weight.device
        layer = cls(in_features, out_features, bias=bias is not None, fmt=fmt, device="meta")
        layer.set_quantized_weight(weight.detach().to(target))
        if bias is not None:
            layer.bias = nn.Parameter(bias.detach().to(target).clone(), requires_grad=False)
        return layer

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, fmt: str, device: torch.device | str | None = None
    ) -> QuantLinear:
        """Quantize an ``nn.Linear`` (on ``device`` if given, else where its weight is)."""
        return cls.from_weight(linear.weight, linear.bias, fmt, device=device)

    def set_quantized_weight(self, weight: torch.Tensor) -> None:
        """Quantize ``weight [out, in]`` where it lies and store the result in this layer."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight shape {tuple(weight.shape)} does not match layer "
                f"[{self.out_features}, {self.in_features}]"
            )
        self.load_quantized_tensors(self.format.quantize(weight))

    def load_quantized_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Install already-quantized tensors (exact names, shapes and dtypes are checked)."""
        specs = self.format.tensor_specs(self.out_features, self.in_features)
        if set(tensors) != set(specs):
            raise ValueError(f"{self.fmt}: expected tensors {sorted(specs)}, got {sorted(tensors)}")
        for name, (shape, dtype) in specs.items():
            t = tensors[name]
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"{self.fmt}: {name} must be {dtype} {shape}, got {t.dtype} {tuple(t.shape)}"
                )
            self._buffers[name] = _own(t)

    # -- behaviour ----------------------------------------------------------------------------

    @property
    def format(self) -> Fp4Format:
        """The format spec of this layer."""
        return FORMATS[self.fmt]

    @property
    def qweight(self) -> torch.Tensor:
        """Alias of ``weight_packed`` (peft locates quantized base layers through it)."""
        return self.weight_packed

    def quantized_tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by compressed-tensors name."""
        return {name: self._buffers[name] for name in self.format.tensor_names}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight ``[out, in]`` in ``dtype``."""
        return self.format.dequantize(self.quantized_tensors(), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T + b`` (see the module docstring for how it runs)."""
        return fp4_linear(x, self)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """Apply ``fn`` (``.to``, ``.cuda``, ``.half`` ...) without changing buffer dtypes.

        Float-typed quantization buffers are shown to ``fn`` as same-width integer views, which
        dtype casts leave alone, and viewed back afterwards: devices move, bits never change.
        """
        hidden: dict[str, torch.dtype] = {}
        for name in self.format.tensor_names:
            t = self._buffers.get(name)
            if t is not None and t.dtype in _INT_TWIN:
                self._buffers[name] = t.view(_INT_TWIN[t.dtype])
                hidden[name] = t.dtype
        try:
            super()._apply(fn, recurse)
        finally:
            for name, dtype in hidden.items():
                self._buffers[name] = _own(self._buffers[name].view(dtype))
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fmt={self.fmt}"
        )


def _format(fmt: str) -> Fp4Format:
    if fmt not in FORMATS:
        raise QerlConfigError(
            "quant.format",
            f"unknown FP4 format {fmt!r}",
            f"use one of {sorted(FORMATS)}",
        )
    return FORMATS[fmt]


# --------------------------------------------------------------------------- whole models


@dataclass
class QuantizeSummary:
    """What :func:`quantize_model_` did: quantized layer names, and skipped ones with reasons."""

    quantized: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def module_matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether a dotted module name matches any pattern.

    A pattern matches when its dotted parts occur as consecutive parts of the name, e.g.
    ``"lm_head"`` matches ``lm_head``, ``"mlp.down_proj"`` matches
    ``model.layers.3.mlp.down_proj`` and ``"layers.0"`` matches every module under layer 0.
    """
    parts = name.split(".")
    for pattern in patterns:
        want = pattern.split(".")
        n = len(want)
        if any(parts[i : i + n] == want for i in range(len(parts) - n + 1)):
            return True
    return False


def check_on_indivisible(value: str) -> None:
    """Validate the ``quant.on_indivisible`` setting."""
    if value not in ("skip", "error"):
        raise QerlConfigError(
            "quant.on_indivisible",
            f"unknown value {value!r}",
            "use 'skip' (keep such layers in full precision, with a warning) or 'error'",
        )


def indivisible_error(name: str, in_features: int, spec: Fp4Format) -> QerlConfigError:
    """The error raised for a layer whose input size is not a multiple of the block size."""
    return QerlConfigError(
        "quant.on_indivisible",
        f"layer {name!r} has in_features={in_features}, not a multiple of the {spec.name} "
        f"block size {spec.block_size}",
        f"set quant.on_indivisible='skip' to keep it in full precision, add {name!r} to "
        "quant.skip_modules, or use nvfp4 (block 16)",
    )


def plan_quantization(
    model: nn.Module,
    fmt: str,
    skip_modules: Iterable[str] = ("lm_head",),
    on_indivisible: OnIndivisible = "skip",
) -> QuantizeSummary:
    """Decide, without touching weights, which ``nn.Linear`` modules get quantized.

    Raises ``QerlConfigError`` for an unknown format or ``on_indivisible`` value, and for the
    first indivisible layer when ``on_indivisible == "error"``; warns for skipped indivisible ones.
    """
    spec = _format(fmt)
    check_on_indivisible(on_indivisible)
    skip = tuple(skip_modules)
    plan = QuantizeSummary()
    for name, module in model.named_modules():
        if _is_adapter_name(name):
            raise ValueError(
                f"module {name!r} belongs to a LoRA adapter: quantize the base model before "
                "applying LoRA"
            )
        if type(module) is not nn.Linear:
            continue
        if module_matches(name, skip):
            plan.skipped[name] = "in skip_modules"
        elif not spec.divides(module.in_features):
            if on_indivisible == "error":
                raise indivisible_error(name, module.in_features, spec)
            reason = (
                f"in_features={module.in_features} is not a multiple of the {fmt} block size "
                f"{spec.block_size}"
            )
            warnings.warn(
                f"not quantizing {name}: {reason}; it stays in full precision", stacklevel=3
            )
            plan.skipped[name] = reason
        else:
            plan.quantized.append(name)
    return plan


def _is_adapter_name(name: str) -> bool:
    return any(p.startswith("lora_") or p == "base_layer" for p in name.split("."))


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replace the submodule at dotted path ``name``."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, module)


def quantize_model_(
    model: nn.Module,
    fmt: str,
    skip_modules: Iterable[str] = ("lm_head",),
    on_indivisible: OnIndivisible = "skip",
    device: torch.device | str | None = None,
) -> QuantizeSummary:
    """Replace every ``nn.Linear`` of ``model`` (except skipped ones) by a ``QuantLinear``, in place.

    Layers are quantized one at a time on ``device`` (default: where each weight is), and the
    full-precision weight of a layer is released as soon as it is replaced, so with a CPU model and
    ``device="cuda"`` only one full-precision layer is ever on the accelerator. Modules that are not
    quantized are not moved: call ``model.to(device)`` afterwards (quantized buffers keep their
    dtypes). A layer whose ``in_features`` is not a multiple of the block size is skipped with a
    warning (``on_indivisible="skip"``) or refused with ``QerlConfigError`` (``"error"``), checked
    for all layers before any is changed.
    """
    plan = plan_quantization(model, fmt, skip_modules, on_indivisible)
    for name in plan.quantized:
        linear = model.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        set_submodule(model, name, QuantLinear.from_linear(linear, fmt, device=device))
        del linear
    return plan
