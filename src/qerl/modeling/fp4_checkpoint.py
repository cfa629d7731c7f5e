"""Save and reload our NVFP4 / MXFP4 models bit-identically (compressed-tensors layout).

A checkpoint is a ``model.safetensors`` holding the state dict (``<layer>.weight_packed`` /
``.weight_scale`` / ``.weight_global_scale`` for quantized layers, plain tensors otherwise; a
tied output embedding stored once) plus a ``config.json`` with a compressed-tensors style
``quantization_config`` and a ``qerl_quantization`` entry for our own reload. Written atomically
(temporary directory + rename); reloaded with every tensor in the dtype and bits it was saved in.

Stock transformers + compressed-tensors also load it, in bfloat16 only: compressed-tensors
decompresses FP4 weights to bfloat16 whatever the model's dtype (so float32 / float16 activations
meet bfloat16 weights: "self and mat2 must have the same dtype"). The config's ``dtype`` therefore
says ``bfloat16``, and ``from_pretrained(path)`` (dtype ``auto``) works; our own reload takes the
dtype from ``qerl_quantization`` instead (float32 on CPU), so it stays bit-identical.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from qerl.atomic import atomic_directory
from qerl.errors import QerlConfigError
from qerl.modeling.devices import dtype_name, resolve_compute_dtype, resolve_device
from qerl.modeling.model_dir import (
    QERL_CONFIG_KEY,
    has_tokenizer,
    load_config,
    load_tokenizer,
    validate_model_dir,
)
from qerl.modeling.skeleton import (
    build_skeleton,
    embedding_names,
    fill_from_checkpoint,
    finish,
    install_shell,
    ties_embeddings,
)
from qerl.modeling.weights import CHECKPOINT_FILE, keys_with_suffix
from qerl.quant.formats import FORMATS
from qerl.quant.linear import QuantLinear

__all__ = ["load_quantized", "save_quantized"]


def save_quantized(model: nn.Module, tokenizer: Any, out_dir: str | os.PathLike[str]) -> Path:
    """Write an nvfp4/mxfp4 model (and its tokenizer, if given) to ``out_dir`` atomically.

    Layout: see the module docstring. An existing ``out_dir`` is replaced only once the new one
    is complete.
    """
    from safetensors.torch import save_file

    if hasattr(model, "peft_config") or any(
        p.startswith("lora_") or p == "base_layer"
        for name, _ in model.named_modules()
        for p in name.split(".")
    ):
        raise ValueError(
            "save_quantized takes the quantized base model without LoRA layers: save adapters "
            "with PeftModel.save_pretrained, and the base with save_quantized before apply_lora"
        )
    fmt = _model_fp4_format(model)
    tensors = _deduplicated_state_dict(model)
    config = copy.deepcopy(model.config)
    config.quantization_config = _compressed_tensors_config(model, fmt)
    config.dtype = torch.bfloat16  # what stock compressed-tensors runs it in (module docstring)
    setattr(
        config,
        QERL_CONFIG_KEY,
        {"format": fmt, "dtype": dtype_name(_float_dtype(model)), "version": 1},
    )
    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        save_file(tensors, str(tmp / CHECKPOINT_FILE), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
    return out.expanduser()


def load_quantized(
    out_dir: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> tuple[Any, Any]:
    """Reload a :func:`save_quantized` directory bit-identically onto ``device``.

    Returns ``(model, tokenizer)``; the tokenizer is ``None`` if none was saved. Every tensor
    keeps the dtype and bits it was saved with. The weight files are checked first
    (:func:`qerl.modeling.model_dir.validate_model_dir`).
    """
    path, headers = validate_model_dir(out_dir, field="checkpoint.path")
    dev = resolve_device(device)
    raw = json.loads((path / "config.json").read_text())
    meta = raw.get(QERL_CONFIG_KEY)
    if not isinstance(meta, dict) or meta.get("format") not in FORMATS:
        raise QerlConfigError(
            "checkpoint.path",
            f"{str(path)!r} was not written by save_quantized (no {QERL_CONFIG_KEY} in config.json)",
            "use load_policy_base for ordinary checkpoints",
        )
    fmt = meta["format"]
    dtype = resolve_compute_dtype(meta.get("dtype", "float32"), dev)
    config = load_config(path)
    model = build_skeleton(config, dtype)
    for name in keys_with_suffix(headers, ".weight_packed"):
        install_shell(model, name, fmt)
    fill_from_checkpoint(model, list(headers), dev, quantize=False)
    finish(model, config, dev, field="checkpoint.path")
    model.eval()
    tokenizer = load_tokenizer(path) if has_tokenizer(path) else None
    return model, tokenizer


def _model_fp4_format(model: nn.Module) -> str:
    formats = {m.fmt for m in model.modules() if isinstance(m, QuantLinear)}
    if len(formats) != 1:
        raise ValueError(
            f"save_quantized needs a model quantized in exactly one of {sorted(FORMATS)}, "
            f"found {sorted(formats) or 'no QuantLinear layers'}"
        )
    return formats.pop()


def _float_dtype(model: nn.Module) -> torch.dtype:
    """Dtype of the model's unquantized floating-point parameters (its compute dtype)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _deduplicated_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Contiguous state dict with a tied output embedding stored once (safetensors rejects shared
    storage); any other tensors that share memory are stored as separate copies."""
    state = model.state_dict()
    _, out_name = embedding_names(model)
    tied_key = f"{out_name}.weight" if out_name and ties_embeddings(model.config) else None
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    tensors: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        if key == tied_key and not isinstance(model.get_submodule(out_name), QuantLinear):
            continue
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        t = t.detach().to("cpu").contiguous()
        if ident in seen:
            t = t.clone()
        seen.add(ident)
        tensors[key] = t
    return tensors


def _compressed_tensors_config(model: nn.Module, fmt: str) -> dict[str, Any]:
    """A compressed-tensors style ``quantization_config`` for a weight-only FP4 model."""
    spec = FORMATS[fmt]
    ignore = sorted(name for name, m in model.named_modules() if type(m) is nn.Linear)
    weights = {
        "num_bits": 4,
        "type": "float",
        "symmetric": True,
        "strategy": spec.ct_strategy,
        "group_size": spec.block_size,
        "block_structure": None,
        "dynamic": False,
        "actorder": None,
        "observer": "minmax",
        "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors",
        "format": spec.ct_format,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": None,
                "output_activations": None,
                "format": spec.ct_format,
            }
        },
        "ignore": ignore,
        "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {},
    }
