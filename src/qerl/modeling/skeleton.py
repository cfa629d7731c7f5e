"""Meta-device model skeletons, filled one tensor at a time (the streaming loader's core).

The skeleton is the model with its parameters on the meta device (no memory) and its computed
buffers (e.g. the rotary ``inv_freq``) real, exactly as the modules' constructors make them.
Linear layers to quantize are swapped for empty :class:`~qerl.quant.linear.QuantLinear` shells;
:func:`fill_from_checkpoint` then streams a checkpoint into it: a Linear weight is quantized on
the target device and dropped before the next tensor is read, so at most one full-precision
weight matrix is alive at a time; every other tensor is copied to the device (never kept as a
view of the memory-mapped file, so each shard is unmapped once it has been read).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl.errors import QerlConfigError
from qerl.modeling.weights import iter_tensors
from qerl.quant.linear import QuantLinear, set_submodule
from qerl.quant.report import layer_report_row

__all__ = [
    "build_skeleton",
    "embedding_names",
    "fill_from_checkpoint",
    "finish",
    "install_shell",
    "quantize_into",
    "ties_embeddings",
]


def build_skeleton(config: Any, dtype: torch.dtype) -> Any:
    """The model with parameters on the meta device and real (CPU) buffers, in ``dtype``."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)


def install_shell(model: nn.Module, name: str, fmt: str) -> QuantLinear:
    """Swap the ``nn.Linear`` at ``name`` for an empty (meta) ``QuantLinear`` of the same shape."""
    linear = model.get_submodule(name)
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"{name!r} holds quantized tensors but is not a Linear in this model")
    bias_dtype = linear.bias.dtype if linear.bias is not None else None
    shell = QuantLinear(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        fmt=fmt,
        device="meta",
        dtype=bias_dtype,
    )
    set_submodule(model, name, shell)
    return shell


def ties_embeddings(config: Any) -> bool:
    """Whether the config ties the output embedding to the input embedding."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", False))


def embedding_names(model: Any) -> tuple[str | None, str | None]:
    """Dotted names of the input and output embedding modules (``None`` if absent)."""
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names: dict[int, str] = {id(m): n for n, m in model.named_modules()}
    return (
        names.get(id(inp)) if inp is not None else None,
        names.get(id(out)) if out is not None else None,
    )


def quantize_into(
    layer: QuantLinear, name: str, weight: torch.Tensor, device: torch.device
) -> dict[str, object]:
    """Quantize ``weight`` on ``device`` into ``layer``; return its report row (with the error)."""
    w = weight.to(device)
    layer.set_quantized_weight(w)
    row = layer_report_row(name, layer, w)
    assert row is not None
    return row


def fill_from_checkpoint(
    model: Any, files: list[Path], device: torch.device, *, quantize: bool, tie: bool = False
) -> dict[str, dict[str, object]]:
    """Stream every checkpoint tensor into ``model`` on ``device``, one tensor at a time.

    With ``quantize=True`` a ``QuantLinear``'s float ``weight`` is quantized on ``device`` (and a
    report row with its error recorded) and other tensors take the skeleton's dtype; with
    ``quantize=False`` every tensor is placed exactly as stored (quantized checkpoints). Each
    tensor read is released before the next one is read.
    """
    modules = dict(model.named_modules())
    in_name, out_name = embedding_names(model)
    tied_quant_out = tie and out_name is not None and isinstance(modules.get(out_name), QuantLinear)
    rows: dict[str, dict[str, object]] = {}
    unexpected: list[str] = []
    for key, tensor in iter_tensors(files):
        name, _, attr = key.rpartition(".")
        module = modules.get(name)
        if module is None:
            unexpected.append(key)
        elif tie and name == out_name and attr == "weight":
            pass  # tied: the output embedding is taken from the input embedding
        elif isinstance(module, QuantLinear) and quantize and attr == "weight":
            rows[name] = quantize_into(module, name, tensor, device)
        elif isinstance(module, QuantLinear) and attr in module.format.tensor_names:
            _check_quantized_tensor(module, key, tensor)
            module._buffers[attr] = _owned(tensor, device)
        elif not _assign(module, attr, tensor, device, cast=quantize):
            unexpected.append(key)
        if tied_quant_out and name == in_name and attr == "weight":
            out = modules[out_name]  # type: ignore[index]
            rows[out_name] = quantize_into(out, out_name, tensor, device)  # type: ignore[arg-type]
        del tensor  # nothing from this step outlives it: the next read starts from zero
    if unexpected:
        warnings.warn(f"checkpoint tensors not used by the model: {unexpected[:10]}", stacklevel=3)
    return rows


def _check_quantized_tensor(layer: QuantLinear, key: str, tensor: torch.Tensor) -> None:
    """Refuse a stored quantized tensor whose shape or dtype does not fit the layer."""
    attr = key.rpartition(".")[2]
    shape, dtype = layer.format.tensor_specs(layer.out_features, layer.in_features)[attr]
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise QerlConfigError(
            "checkpoint.path",
            f"{key} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape} for "
            f"{layer.fmt}",
            "re-save the model with save_quantized",
        )


def _owned(
    tensor: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``tensor`` on ``device`` in ``dtype``, in memory of its own.

    ``safe_open(...).get_tensor`` on the CPU returns a view of the memory-mapped file; a kept
    view (even a 1 KB bias) would hold the whole shard mapped, resident and tied to the file
    (which must then never change on disk), so what the model keeps is always copied.
    """
    return tensor.to(device=device, dtype=dtype, copy=True)


def _assign(
    module: nn.Module, attr: str, tensor: torch.Tensor, device: torch.device, *, cast: bool
) -> bool:
    """Place ``tensor`` as parameter/buffer ``attr`` of ``module``; False if there is none."""
    if attr in module._parameters:
        old = module._parameters[attr]
        dtype = (
            old.dtype if (cast and old is not None and tensor.is_floating_point()) else tensor.dtype
        )
        requires_grad = old.requires_grad if old is not None else False
        value = _owned(tensor, device, dtype)
        module._parameters[attr] = nn.Parameter(
            value, requires_grad=requires_grad and value.is_floating_point()
        )
        return True
    if attr in module._buffers:
        old_buf = module._buffers[attr]
        dtype = (
            old_buf.dtype
            if (cast and old_buf is not None and tensor.is_floating_point())
            else tensor.dtype
        )
        module._buffers[attr] = _owned(tensor, device, dtype)
        return True
    return False


def finish(model: Any, config: Any, device: torch.device, field: str = "model.path") -> None:
    """Tie embeddings, move computed buffers to ``device``, and check nothing is left on meta."""
    in_name, out_name = embedding_names(model)
    if ties_embeddings(config) and in_name and out_name:
        out = model.get_submodule(out_name)
        if not isinstance(out, QuantLinear):
            out.weight = model.get_submodule(in_name).weight
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None and not buf.is_meta and buf.device != device:
                module._buffers[key] = buf.to(device)
    left = [n for n, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    left += [n for n, b in model.named_buffers(remove_duplicate=False) if b.is_meta]
    if left:
        raise QerlConfigError(
            field,
            f"the checkpoint does not provide {len(left)} tensors the model needs, e.g. {left[:5]}",
            f"point {field} at a complete checkpoint for this config",
        )
