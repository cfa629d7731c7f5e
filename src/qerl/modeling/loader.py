"""Load the frozen policy base in a chosen weight format, and save/reload our FP4 checkpoints.

Formats (``quant.format``):

- ``none``: ``AutoModelForCausalLM.from_pretrained`` in ``compute_dtype`` (the bf16 LoRA baseline).
- ``nf4`` / ``fp4``: bitsandbytes 4-bit through transformers' ``BitsAndBytesConfig``.
- ``nvfp4`` / ``mxfp4``: our own formats (:mod:`qerl.quant.formats`), quantized layer by layer while
  loading. The model skeleton is built with its parameters on the meta device (buffers such as
  the rotary ``inv_freq`` are computed for real by the modules' own constructors, exactly as in a
  normal load), every ``nn.Linear`` to quantize is swapped for an empty ``QuantLinear`` shell, and
  the safetensors file(s) are streamed one tensor at a time: a Linear weight is moved to the
  target device, quantized there and dropped; every other tensor is cast to the skeleton's dtype
  and placed on the device. The full-precision model is never whole on the accelerator (at most
  one full-precision weight matrix is). Tied input/output embeddings are re-tied, and the loader
  refuses to return a model with any tensor left on the meta device.

Checkpoints of our FP4 models (:func:`save_quantized` / :func:`load_quantized`) are a
``model.safetensors`` holding the state dict (compressed-tensors tensor names) plus a
``config.json`` with a compressed-tensors style ``quantization_config``; they are written
atomically (temporary directory + rename) and reload bit-identically.

Nothing here touches the network or runs remote code: ``local_files_only=True`` and
``trust_remote_code=False`` everywhere; weights are read from safetensors only.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from qerl.atomic import atomic_directory
from qerl.errors import QerlConfigError
from qerl.quant.formats import FORMATS
from qerl.quant.linear import (
    QuantLinear,
    check_on_indivisible,
    layer_report_row,
    plan_quantization,
    quant_report,
    set_submodule,
)

__all__ = [
    "QUANT_FORMATS",
    "load_policy_base",
    "load_quantized",
    "resolve_compute_dtype",
    "resolve_device",
    "save_quantized",
]

QUANT_FORMATS: tuple[str, ...] = ("none", "nf4", "fp4", "nvfp4", "mxfp4")
CHECKPOINT_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
QERL_CONFIG_KEY = "qerl_quantization"

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

Report = list[dict[str, object]]


# --------------------------------------------------------------------------- validation


def _validate_model_path(model_path: str | os.PathLike[str], field: str = "model.path") -> Path:
    """A local model directory with a config.json and safetensors weights."""
    path = Path(model_path).expanduser()
    if not path.is_dir():
        raise QerlConfigError(
            field,
            f"{str(path)!r} is not an existing directory",
            "point it at a local model directory (no hub downloads happen at run time)",
        )
    if not (path / "config.json").is_file():
        raise QerlConfigError(
            field,
            f"{str(path)!r} has no config.json",
            "point it at a directory written by save_pretrained (config.json + model.safetensors)",
        )
    _safetensors_files(path, field)
    return path


def _safetensors_files(path: Path, field: str = "model.path") -> list[Path]:
    """The checkpoint's safetensors shard(s), in a stable order."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise QerlConfigError(
                field,
                f"shards {missing} listed in {INDEX_FILE} are missing",
                "restore the complete checkpoint",
            )
        return files
    single = path / CHECKPOINT_FILE
    if single.is_file():
        return [single]
    raise QerlConfigError(
        field,
        f"{str(path)!r} has no {CHECKPOINT_FILE} (or {INDEX_FILE})",
        "save the model with save_pretrained(..., safe_serialization=True); pickled weights "
        "are never loaded",
    )


def _validate_format(fmt: str) -> None:
    if fmt not in QUANT_FORMATS:
        raise QerlConfigError(
            "quant.format",
            f"unknown format {fmt!r}",
            f"use one of {', '.join(QUANT_FORMATS)}",
        )


def resolve_device(device: str | torch.device) -> torch.device:
    """Parse and check a device (field ``model.device``); a bare "cuda" gets the current index."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise QerlConfigError(
            "model.device", f"{device!r} is not a device ({exc})", "use 'cpu' or 'cuda[:N]'"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise QerlConfigError(
                "model.device",
                f"{device!r} requested but CUDA is not available",
                "use 'cpu' on this machine",
            )
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_compute_dtype(
    compute_dtype: torch.dtype | str | None, device: torch.device
) -> torch.dtype:
    """``None`` -> bfloat16 on accelerators and float32 on CPU; strings like "bf16" are accepted."""
    if compute_dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(compute_dtype, torch.dtype):
        if compute_dtype in _DTYPE_ALIASES.values():
            return compute_dtype
    elif str(compute_dtype).removeprefix("torch.") in _DTYPE_ALIASES:
        return _DTYPE_ALIASES[str(compute_dtype).removeprefix("torch.")]
    raise QerlConfigError(
        "model.compute_dtype",
        f"unsupported dtype {compute_dtype!r}",
        "use one of float32, bfloat16, float16",
    )


def _require_bitsandbytes(fmt: str) -> None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise QerlConfigError(
            "quant.format",
            f"{fmt!r} needs bitsandbytes, which cannot be imported ({exc})",
            "install bitsandbytes or choose nvfp4 / mxfp4 / none",
        ) from None


# --------------------------------------------------------------------------- public loaders


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
        model_path: local directory with config.json, safetensors weights and a tokenizer.
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
        row per linear layer (see :func:`qerl.quant.linear.quant_report`), with ``rel_error``
        measured against the checkpoint's weights.

    Raises:
        QerlConfigError: bad path, unknown format, bad device / dtype / on_indivisible value, an
            indivisible layer with ``on_indivisible="error"`` -- all before any weight is read.
    """
    path = _validate_model_path(model_path)
    _validate_format(fmt)
    check_on_indivisible(on_indivisible)
    dev = resolve_device(device)
    dtype = resolve_compute_dtype(compute_dtype, dev)
    if fmt in ("nf4", "fp4"):
        _require_bitsandbytes(fmt)
    tokenizer = _load_tokenizer(path)
    if fmt == "none":
        model = _from_pretrained(path, dev, dtype)
        rows = quant_report(model)
    elif fmt in ("nf4", "fp4"):
        model = _from_pretrained(
            path, dev, dtype, _bnb_config(fmt, dtype, bnb_double_quant, skip_modules)
        )
        keep_bnb_weights_trainable(model)
        rows = _report_against_checkpoint(model, _safetensors_files(path), dev)
    else:
        model, rows = _load_fp4_streaming(
            path, fmt, dev, dtype, tuple(skip_modules), on_indivisible
        )
    model.eval()
    return model, tokenizer, rows


def save_quantized(model: nn.Module, tokenizer: Any, out_dir: str | os.PathLike[str]) -> Path:
    """Write an nvfp4/mxfp4 model (and its tokenizer, if given) to ``out_dir`` atomically.

    Layout: ``model.safetensors`` (the state dict: ``<layer>.weight_packed`` / ``.weight_scale``
    / ``.weight_global_scale`` for quantized layers, plain tensors otherwise; a tied output
    embedding is stored once), ``config.json`` with a compressed-tensors ``quantization_config``
    (plus a ``qerl_quantization`` entry for our own reload), the generation config and tokenizer.
    An existing ``out_dir`` is replaced only once the new one is complete.
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
    setattr(
        config,
        QERL_CONFIG_KEY,
        {"format": fmt, "dtype": _dtype_name(_float_dtype(model)), "version": 1},
    )

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / CHECKPOINT_FILE), metadata={"format": "pt"})
        config.save_pretrained(str(tmp))
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    return _write_atomically(Path(out_dir), write)


def load_quantized(
    out_dir: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> tuple[Any, Any]:
    """Reload a :func:`save_quantized` directory bit-identically onto ``device``.

    Returns ``(model, tokenizer)``; the tokenizer is ``None`` if none was saved. Every tensor
    keeps the dtype and bits it was saved with.
    """
    path = _validate_model_path(out_dir, field="checkpoint.path")
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
    config = _load_config(path)
    files = _safetensors_files(path, "checkpoint.path")
    model = _build_skeleton(config, dtype)
    quantized = _keys_with_suffix(files, ".weight_packed")
    for name in quantized:
        _install_shell(model, name, fmt)
    _fill_from_checkpoint(model, files, dev, quantize=False)
    _finish(model, config, dev)
    model.eval()
    tokenizer = _load_tokenizer(path) if _has_tokenizer(path) else None
    return model, tokenizer


# --------------------------------------------------------------------------- none / bnb paths


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


def keep_bnb_weights_trainable(model: nn.Module) -> int:
    """Stop bitsandbytes from repacking ``Linear4bit`` weights for CPU inference; returns how many
    layers were touched.

    bitsandbytes 0.50 converts a ``Linear4bit`` weight in place to an AVX512-BF16 layout the first
    time it runs an eval-mode forward without grad on a CPU that has AVX512-BF16 (our
    ``evaluate_before`` or the first rollout), and never converts it back. From then on every
    ``matmul_4bit`` on CPU goes through ``gemv_4bit``, which has no backward, so in training no
    gradient reaches a layer's input through the frozen base weight and the LoRA adapters of every
    earlier layer learn from a truncated gradient (q/k/v/gate/up get exactly 0 while lora_B is 0).
    That is why NF4/FP4 did not learn in the first quantization study. The flag is bitsandbytes'
    own per-layer switch (``support_avx512bf16_for_cpu``); the cost is the slower, unpacked CPU
    inference path.
    """
    try:
        import bitsandbytes as bnb
    except ImportError:
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
            n += 1
    return n


def _bnb_config(
    fmt: str, dtype: torch.dtype, double_quant: bool, skip_modules: Iterable[str]
) -> Any:
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=fmt,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=dtype,
        llm_int8_skip_modules=list(skip_modules),
    )


def _report_against_checkpoint(model: nn.Module, files: list[Path], device: torch.device) -> Report:
    """Report rows for a loaded model, streaming the checkpoint's Linear weights as references."""
    modules = dict(model.named_modules())
    rows: dict[str, dict[str, object]] = {}
    for key, tensor in _iter_tensors(files):
        name, _, attr = key.rpartition(".")
        if attr != "weight" or not isinstance(modules.get(name), nn.Linear):
            continue  # bitsandbytes' Linear4bit is an nn.Linear too
        row = layer_report_row(name, modules[name], tensor.to(device))
        if row is not None:
            rows[name] = row
    return [rows.get(r["name"], r) for r in quant_report(model)]  # type: ignore[arg-type]


# --------------------------------------------------------------------------- FP4 streaming path


def _load_fp4_streaming(
    path: Path,
    fmt: str,
    device: torch.device,
    dtype: torch.dtype,
    skip_modules: tuple[str, ...],
    on_indivisible: Literal["skip", "error"],
) -> tuple[Any, Report]:
    """Build a meta skeleton, then quantize Linear weights one by one as they are read."""
    config = _load_config(path)
    model = _build_skeleton(config, dtype)
    plan = plan_quantization(model, fmt, skip_modules, on_indivisible)
    for name in plan.quantized:
        _install_shell(model, name, fmt)
    files = _safetensors_files(path)
    rows = _fill_from_checkpoint(model, files, device, quantize=True, tie=_ties_embeddings(config))
    _finish(model, config, device)
    return model, [rows.get(r["name"], r) for r in quant_report(model)]  # type: ignore[arg-type]


def _load_config(path: Path) -> Any:
    """The model config without any stored quantization_config (we handle quantization)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    if hasattr(config, QERL_CONFIG_KEY):
        delattr(config, QERL_CONFIG_KEY)
    return config


def _build_skeleton(config: Any, dtype: torch.dtype) -> Any:
    """The model with parameters on the meta device and real (CPU) buffers, in ``dtype``."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=False)


def _install_shell(model: nn.Module, name: str, fmt: str) -> None:
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


def _ties_embeddings(config: Any) -> bool:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return bool(getattr(text_config, "tie_word_embeddings", False))


def _embedding_names(model: Any) -> tuple[str | None, str | None]:
    """Dotted names of the input and output embedding modules (``None`` if absent)."""
    inp = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names: dict[int, str] = {id(m): n for n, m in model.named_modules()}
    return (
        names.get(id(inp)) if inp is not None else None,
        names.get(id(out)) if out is not None else None,
    )


def _fill_from_checkpoint(
    model: Any, files: list[Path], device: torch.device, *, quantize: bool, tie: bool = False
) -> dict[str, dict[str, object]]:
    """Stream every checkpoint tensor into ``model`` on ``device``.

    With ``quantize=True`` a ``QuantLinear``'s float ``weight`` is quantized on ``device`` (and a
    report row with its error recorded) and other tensors take the skeleton's dtype; with
    ``quantize=False`` every tensor is placed exactly as stored (quantized checkpoints).
    """
    modules = dict(model.named_modules())
    in_name, out_name = _embedding_names(model)
    tied_quant_out = tie and out_name is not None and isinstance(modules.get(out_name), QuantLinear)
    rows: dict[str, dict[str, object]] = {}
    unexpected: list[str] = []
    for key, tensor in _iter_tensors(files):
        name, _, attr = key.rpartition(".")
        module = modules.get(name)
        if module is None:
            unexpected.append(key)
            continue
        if tie and name == out_name and attr == "weight":
            continue  # tied: the output embedding is taken from the input embedding
        if isinstance(module, QuantLinear) and quantize and attr == "weight":
            rows[name] = _quantize_into(module, name, tensor, device)
        elif isinstance(module, QuantLinear) and attr in module.format.tensor_names:
            _check_quantized_tensor(module, key, tensor)
            module._buffers[attr] = tensor.to(device)
        elif not _assign(module, attr, tensor, device, cast=quantize):
            unexpected.append(key)
        if tied_quant_out and name == in_name and attr == "weight":
            rows[out_name] = _quantize_into(modules[out_name], out_name, tensor, device)  # type: ignore[arg-type]
    if unexpected:
        import warnings

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


def _quantize_into(
    layer: QuantLinear, name: str, weight: torch.Tensor, device: torch.device
) -> dict[str, object]:
    """Quantize ``weight`` on ``device`` into ``layer``; return its report row (with the error)."""
    w = weight.to(device)
    layer.set_quantized_weight(w)
    row = layer_report_row(name, layer, w)
    assert row is not None
    return row


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
        value = tensor.to(device=device, dtype=dtype)
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
        module._buffers[attr] = tensor.to(device=device, dtype=dtype)
        return True
    return False


def _finish(model: Any, config: Any, device: torch.device) -> None:
    """Tie embeddings, move computed buffers to ``device``, and check nothing is left on meta."""
    in_name, out_name = _embedding_names(model)
    if _ties_embeddings(config) and in_name and out_name:
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
            "model.path",
            f"the checkpoint does not provide {len(left)} tensors the model needs, e.g. {left[:5]}",
            "point model.path at a complete checkpoint for this config",
        )


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, cpu tensor)`` one at a time from safetensors files."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)


def _keys_with_suffix(files: list[Path], suffix: str) -> list[str]:
    """Module names ``m`` for which ``m + suffix`` is a key in the checkpoint."""
    from safetensors import safe_open

    names = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            names += [k[: -len(suffix)] for k in handle.keys() if k.endswith(suffix)]
    return sorted(names)


# --------------------------------------------------------------------------- tokenizer


def _has_tokenizer(path: Path) -> bool:
    return any(
        (path / f).is_file()
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    )


def _load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=False
        )
    except (OSError, ValueError) as exc:
        raise QerlConfigError(
            "model.path",
            f"no tokenizer could be loaded from {str(path)!r} ({exc})",
            "save the tokenizer next to the weights with tokenizer.save_pretrained(model.path)",
        ) from None


# --------------------------------------------------------------------------- saving helpers


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _deduplicated_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Contiguous state dict with a tied output embedding stored once (safetensors rejects shared
    storage); any other tensors that share memory are stored as separate copies."""
    state = model.state_dict()
    _, out_name = _embedding_names(model)
    tied_key = f"{out_name}.weight" if out_name and _ties_embeddings(model.config) else None
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


def _write_atomically(out: Path, write: Any) -> Path:
    """Run ``write(tmp_dir)`` in a hidden sibling directory, then rename it to ``out``."""
    with atomic_directory(out) as tmp:
        write(tmp)
    return out.expanduser()
