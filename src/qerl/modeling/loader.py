"""Load the frozen policy base in a chosen weight format.

Formats (``quant.format``):

- ``none``: ``AutoModelForCausalLM.from_pretrained`` in ``compute_dtype`` (the bf16 LoRA baseline).
- ``nf4`` / ``fp4``: bitsandbytes 4-bit through transformers' ``BitsAndBytesConfig``;
  transformers quantizes each weight as it reads it (one tensor at a time when quantizing on
  the fly).
- ``nvfp4`` / ``mxfp4``: our own formats (:mod:`qerl.quant.formats`), quantized while the
  checkpoint streams (:mod:`qerl.modeling.skeleton`): a meta-device skeleton with empty
  ``QuantLinear`` shells, then the safetensors file(s) -- a single file or every shard of an
  index -- read one tensor at a time; a Linear weight is moved to the target device, quantized
  there and released before the next tensor is read. Host memory holds one tensor at a time and
  no full-precision copy of a quantized layer outlives its quantization. Tied embeddings are
  re-tied; a model with any tensor left on the meta device is refused.

Before any of that, the model directory and *every* safetensors file it holds are checked
(:func:`qerl.modeling.model_dir.validate_model_dir`): a truncated, garbage or foreign file (a
torch pickle) or an index naming missing shards or tensors is one clear error naming the file.

Our FP4 checkpoints are saved and reloaded by :mod:`qerl.modeling.fp4_checkpoint`
(re-exported here). Nothing here touches the network or runs remote code:
``local_files_only=True`` and ``trust_remote_code=False`` everywhere; weights are read from
safetensors only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from qerl.errors import QerlConfigError
from qerl.modeling.bnb import (
    BNB_FORMATS,
    bnb_config,
    keep_bnb_weights_trainable,
    require_bitsandbytes,
)
from qerl.modeling.devices import resolve_compute_dtype, resolve_device
from qerl.modeling.fp4_checkpoint import load_quantized, save_quantized
from qerl.modeling.model_dir import load_config, load_tokenizer, validate_model_dir
from qerl.modeling.skeleton import (
    build_skeleton,
    fill_from_checkpoint,
    finish,
    install_shell,
    ties_embeddings,
)
from qerl.modeling.weights import iter_tensors
from qerl.quant.formats import QUANT_FORMATS
from qerl.quant.linear import check_on_indivisible, plan_quantization
from qerl.quant.report import layer_report_row, quant_report

__all__ = [
    "QUANT_FORMATS",
    "check_quant_format",
    "keep_bnb_weights_trainable",
    "load_policy_base",
    "load_quantized",
    "resolve_compute_dtype",
    "resolve_device",
    "save_quantized",
]

Report = list[dict[str, object]]


def check_quant_format(fmt: str) -> None:
    """Refuse an unknown ``quant.format``, listing the known ones."""
    if fmt not in QUANT_FORMATS:
        raise QerlConfigError(
            "quant.format",
            f"unknown format {fmt!r}",
            f"use one of {', '.join(QUANT_FORMATS)}",
        )


def load_policy_base(
    model_path: str | os.PathLike[str],
    fmt: str,
    *,
    device: str | torch.device = "cpu",
    compute_dtype: torch.dtype | str | None = None,
    bnb_double_quant: bool = True,
    skip_modules: Iterable[str] = ("lm_head",),
    on_indivisible: Literal["skip", "error"] = "skip",
) -> tuple[Any, Any, Report]:
    """Load a causal LM from a local directory with its weights in ``fmt``.

    Args:
        model_path: local directory with config.json, safetensors weights (one file or an
            index + shards) and a tokenizer.
        fmt: one of ``none``, ``nf4``, ``fp4``, ``nvfp4``, ``mxfp4``.
        device: where the model lives ("cpu", "cuda", "cuda:1", ...).
        compute_dtype: dtype of the unquantized parts and of bnb's matmuls (default: bf16 on GPU,
            fp32 on CPU).
        bnb_double_quant: bitsandbytes' nested quantization of the block scales (nf4/fp4 only).
        skip_modules: Linear modules kept in full precision (dotted-name patterns).
        on_indivisible: nvfp4/mxfp4 layers whose ``in_features`` is not a multiple of the block
            size are kept in full precision with a warning ("skip") or refused ("error").

    Returns:
        ``(model, tokenizer, report_rows)``; the model is in eval mode; ``report_rows`` has one
        row per linear layer (see :func:`qerl.quant.report.quant_report`), with ``rel_error``
        measured against the checkpoint's weights.

    Raises:
        QerlConfigError: bad path, a corrupt / truncated / foreign weight file, unknown format,
            bad device / dtype / on_indivisible value, an indivisible layer with
            ``on_indivisible="error"`` -- all before any weight is read.
    """
    path, headers = validate_model_dir(model_path)
    files = list(headers)
    check_quant_format(fmt)
    check_on_indivisible(on_indivisible)
    dev = resolve_device(device)
    dtype = resolve_compute_dtype(compute_dtype, dev)
    if fmt in BNB_FORMATS:
        require_bitsandbytes(fmt)
    tokenizer = load_tokenizer(path)
    if fmt == "none":
        model = _from_pretrained(path, dev, dtype)
        rows = quant_report(model)
    elif fmt in BNB_FORMATS:
        model = _from_pretrained(
            path, dev, dtype, bnb_config(fmt, dtype, bnb_double_quant, skip_modules)
        )
        keep_bnb_weights_trainable(model)
        rows = _report_against_checkpoint(model, files, dev)
    else:
        model, rows = _load_fp4_streaming(
            path, files, fmt, dev, dtype, tuple(skip_modules), on_indivisible
        )
    model.eval()
    return model, tokenizer, rows


def _from_pretrained(
    path: Path, device: torch.device, dtype: torch.dtype, quantization_config: Any = None
) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {}
    if quantization_config is not None:
        kwargs["quantization_config"] = quantization_config
    return AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=dtype,
        device_map={"": str(device)},
        use_safetensors=True,
        local_files_only=True,
        trust_remote_code=False,
        **kwargs,
    )


def _report_against_checkpoint(model: nn.Module, files: list[Path], device: torch.device) -> Report:
    """Report rows for a loaded model, streaming the checkpoint's Linear weights as references."""
    modules = dict(model.named_modules())
    rows: dict[str, dict[str, object]] = {}
    for key, tensor in iter_tensors(files):
        name, _, attr = key.rpartition(".")
        if attr == "weight" and isinstance(modules.get(name), nn.Linear):
            # bitsandbytes' Linear4bit is an nn.Linear too
            row = layer_report_row(name, modules[name], tensor.to(device))
            if row is not None:
                rows[name] = row
        del tensor
    return [rows.get(r["name"], r) for r in quant_report(model)]  # type: ignore[arg-type]


def _load_fp4_streaming(
    path: Path,
    files: list[Path],
    fmt: str,
    device: torch.device,
    dtype: torch.dtype,
    skip_modules: tuple[str, ...],
    on_indivisible: Literal["skip", "error"],
) -> tuple[Any, Report]:
    """Build a meta skeleton, then quantize Linear weights one by one as they are read."""
    config = load_config(path)
    model = build_skeleton(config, dtype)
    plan = plan_quantization(model, fmt, skip_modules, on_indivisible)
    for name in plan.quantized:
        install_shell(model, name, fmt)
    rows = fill_from_checkpoint(model, files, device, quantize=True, tie=ties_embeddings(config))
    finish(model, config, device)
    return model, [rows.get(r["name"], r) for r in quant_report(model)]  # type: ignore[arg-type]
