"""Per-layer quantization report: stored bytes, bits per weight and reconstruction error of every
linear-like layer (our ``QuantLinear``, bitsandbytes ``Linear4bit``, plain ``nn.Linear``)."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping

import torch
from torch import nn

from qerl.quant.linear import QuantLinear

__all__ = ["layer_report_row", "quant_report"]


def _relative_error(reference: torch.Tensor, approx: torch.Tensor) -> float:
    ref = reference.detach().to(approx.device, torch.float32)
    denom = torch.linalg.vector_norm(ref)
    if float(denom) == 0.0:
        return 0.0 if float(torch.linalg.vector_norm(approx.float())) == 0.0 else math.inf
    return float(torch.linalg.vector_norm(ref - approx.float()) / denom)


def _bnb_linear4bit_type() -> type | None:
    """bitsandbytes' ``Linear4bit`` class if bitsandbytes is already imported (else ``None``)."""
    if "bitsandbytes" not in sys.modules:
        return None
    return sys.modules["bitsandbytes"].nn.Linear4bit


def _bnb_storage(module: nn.Module) -> tuple[str, int]:
    """(quant type, stored bytes) of a bitsandbytes ``Linear4bit``.

    Stored bytes are the packed codes, the block absmax values and, with double quantization,
    the second-level absmax and offset; the shared 16/256-entry codebooks are not counted.
    """
    weight = module.weight
    state = weight.quant_state
    nbytes = weight.data.numel() * weight.data.element_size()
    nbytes += state.absmax.numel() * state.absmax.element_size()
    if getattr(state, "nested", False) and state.state2 is not None:
        nbytes += state.state2.absmax.numel() * state.state2.absmax.element_size()
        nbytes += 4  # offset, one float32
    return str(state.quant_type), nbytes


def _bnb_dequantize(module: nn.Module) -> torch.Tensor:
    """The dequantized float32 weight of a bitsandbytes ``Linear4bit``."""
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state).float()


_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def layer_report_row(
    name: str, layer: nn.Module, reference: torch.Tensor | None = None
) -> dict[str, object] | None:
    """One report row for a linear-like layer, or ``None`` if ``layer`` is not one.

    Columns: name, format, shape [out, in], n_params (weight elements), weight_bytes (stored
    weight bytes incl. scales), bits_per_weight, rel_error = ||W - deq(W)||_F / ||W||_F against
    ``reference`` (None when no reference is given; 0.0 for full-precision layers).
    """
    bnb_type = _bnb_linear4bit_type()
    if isinstance(layer, QuantLinear):
        out_f, in_f = layer.out_features, layer.in_features
        fmt = layer.fmt
        nbytes = sum(t.numel() * t.element_size() for t in layer.quantized_tensors().values())
        error = None if reference is None else _relative_error(reference, layer.dequantize())
    elif bnb_type is not None and isinstance(layer, bnb_type):
        out_f, in_f = layer.out_features, layer.in_features
        fmt, nbytes = _bnb_storage(layer)
        error = None if reference is None else _relative_error(reference, _bnb_dequantize(layer))
    elif isinstance(layer, nn.Linear) and isinstance(layer.weight, torch.Tensor):
        out_f, in_f = layer.out_features, layer.in_features
        w = layer.weight
        fmt = _DTYPE_NAMES.get(w.dtype, str(w.dtype).removeprefix("torch."))
        nbytes = w.numel() * w.element_size()
        error = 0.0 if reference is None else _relative_error(reference, w.detach())
    else:
        return None
    n_params = out_f * in_f
    return {
        "name": name,
        "format": fmt,
        "shape": [out_f, in_f],
        "n_params": n_params,
        "weight_bytes": int(nbytes),
        "bits_per_weight": 8.0 * nbytes / n_params,
        "rel_error": error,
    }


def _named_layers(
    model_or_layers: nn.Module | Mapping[str, nn.Module] | Iterable[tuple[str, nn.Module]],
) -> Iterable[tuple[str, nn.Module]]:
    """Named candidate layers: a model's modules (LoRA wrappers resolved to their base layer)."""
    if isinstance(model_or_layers, nn.Module):
        model = model_or_layers
        get_base = getattr(model, "get_base_model", None)
        if callable(get_base):  # a peft PeftModel: report on the underlying model's names
            model = get_base()
        for name, module in model.named_modules():
            parts = name.split(".")
            if any(p.startswith("lora_") for p in parts):
                continue
            if parts[-1] == "base_layer":
                yield ".".join(parts[:-1]), module
            else:
                yield name, module
    elif isinstance(model_or_layers, Mapping):
        yield from model_or_layers.items()
    else:
        yield from model_or_layers


def quant_report(
    model_or_layers: nn.Module | Mapping[str, nn.Module] | Iterable[tuple[str, nn.Module]],
    reference_weights: Mapping[str, torch.Tensor] | None = None,
) -> list[dict[str, object]]:
    """Per-layer rows (see :func:`layer_report_row`) for every linear-like layer.

    Handles ``QuantLinear``, bitsandbytes ``Linear4bit`` and plain ``nn.Linear`` (LoRA-wrapped or
    not). ``reference_weights`` maps a module name (or ``<name>.weight``) to its full-precision
    weight; without an entry, quantized layers get ``rel_error = None``.
    """
    refs = reference_weights or {}
    rows = []
    for name, layer in _named_layers(model_or_layers):
        reference = refs.get(name, refs.get(f"{name}.weight"))
        row = layer_report_row(name, layer, reference)
        if row is not None:
            rows.append(row)
    return rows
