"""The policy: a frozen (quantized) base model, its tokenizer and a live LoRA adapter.

``build_policy`` quantizes while loading and wraps the model with peft; ``save_policy`` /
``load_policy`` persist what a later process needs to rebuild the *same* policy without the
original training process (used by single-node reruns): a ``spec.json`` and, for our own 4-bit
formats, the quantized base in the compressed-tensors layout (bit-identical on reload).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from qerl.atomic import atomic_directory
from qerl.errors import QerlConfigError
from qerl.modeling.loader import load_policy_base, load_quantized, save_quantized
from qerl.modeling.lora import LoraSettings, apply_lora

OWN_FORMATS = ("nvfp4", "mxfp4")


@dataclass(frozen=True)
class PolicySpec:
    """Everything needed to rebuild a policy's base model and adapter shape."""

    model_path: str
    format: str = "nvfp4"
    device: str = "auto"
    dtype: str = "auto"
    bnb_double_quant: bool = True
    on_indivisible: str = "skip"
    skip_modules: tuple[str, ...] = ("lm_head",)
    lora: dict[str, Any] = field(default_factory=dict)
    gradient_checkpointing: bool = False


@dataclass
class Policy:
    """A ready-to-train policy. ``model`` is a ``peft.PeftModel``."""

    model: torch.nn.Module
    tokenizer: Any
    spec: PolicySpec
    device: torch.device
    dtype: torch.dtype

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = self.tokenizer.eos_token_id
        cfg_ids = getattr(self.model.config, "eos_token_id", None)
        out = {ids} if isinstance(ids, int) else set(ids or [])
        if isinstance(cfg_ids, int):
            out.add(cfg_ids)
        elif cfg_ids:
            out.update(cfg_ids)
        return tuple(sorted(i for i in out if i is not None))

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.eos_token_ids[0])

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if p.requires_grad and "lora_" in n]

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA weights only (what a checkpoint stores)."""
        from peft import get_peft_model_state_dict

        return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    def load_adapter_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, {k: v.to(self.device) for k, v in state.items()})
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise QerlConfigError(
                "checkpoint.adapter", f"adapter keys do not match the policy: {unexpected[:3]}",
                "resume with the same lora settings as the run that wrote the checkpoint",
            )


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise QerlConfigError("model.device", "cuda requested but no GPU is visible", "use device: auto or cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on GPU, float32 on CPU (CPU bf16 matmuls are slow)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def lora_settings(spec: PolicySpec) -> LoraSettings:
    lora = dict(spec.lora)
    preset = lora.pop("preset", None)
    if preset == "paper":
        return LoraSettings.paper()
    return LoraSettings(**lora)


def build_policy(spec: PolicySpec) -> tuple[Policy, list[dict[str, Any]]]:
    """Load + quantize the base layer by layer, then attach a fresh LoRA adapter."""
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    settings = lora_settings(spec)
    model, tokenizer, report = load_policy_base(
        spec.model_path,
        spec.format,
        device=device,
        compute_dtype=dtype,
        bnb_double_quant=spec.bnb_double_quant,
        skip_modules=tuple(spec.skip_modules),
        on_indivisible=spec.on_indivisible,
    )
    model = apply_lora(model, settings, gradient_checkpointing=spec.gradient_checkpointing).eval()
    return Policy(model=model, tokenizer=tokenizer, spec=spec, device=device, dtype=dtype), report


def save_policy(policy: Policy, out_dir: str | os.PathLike) -> Path:
    """Write ``spec.json`` (+ the quantized base for nvfp4/mxfp4) atomically into ``out_dir``."""
    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        spec = asdict(policy.spec)
        spec["skip_modules"] = list(spec["skip_modules"])
        (tmp / "spec.json").write_text(json.dumps(spec, indent=2))
        if policy.spec.format in OWN_FORMATS:
            base = policy.model.get_base_model()
            with policy.model.disable_adapter():
                save_quantized(_without_lora(base), policy.tokenizer, tmp / "base")
    return out


def load_policy(in_dir: str | os.PathLike) -> Policy:
    """Rebuild a policy saved with :func:`save_policy` (adapter freshly initialised)."""
    root = Path(in_dir)
    spec_file = root / "spec.json"
    if not spec_file.exists():
        raise QerlConfigError(
            "policy", f"no saved policy at {root}",
            "run `kedro run --pipeline=qerl_train` (its setup_quantized_policy node writes it) first",
        )
    raw = json.loads(spec_file.read_text())
    raw["skip_modules"] = tuple(raw.get("skip_modules", ("lm_head",)))
    spec = PolicySpec(**raw)
    if spec.format in OWN_FORMATS and (root / "base").exists():
        device = resolve_device(spec.device)
        dtype = resolve_dtype(spec.dtype, device)
        model, tokenizer = load_quantized(root / "base", device=device)
        model = apply_lora(model, lora_settings(spec), gradient_checkpointing=spec.gradient_checkpointing).eval()
        return Policy(model=model, tokenizer=tokenizer, spec=spec, device=device, dtype=dtype)
    return build_policy(spec)[0]


def _without_lora(model: torch.nn.Module) -> torch.nn.Module:
    """A view of ``model`` whose LoRA wrappers are replaced by their base layers (no copy)."""
    from peft.tuners.lora import LoraLayer

    replacements = [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    if not replacements:
        return model
    clone = _shallow_module_tree(model)
    clone.__dict__.pop("peft_config", None)  # set on the wrapped model by peft
    clone.__dict__.pop("_hf_peft_config_loaded", None)
    for name, layer in replacements:
        parent_name, _, child = name.rpartition(".")
        parent = clone.get_submodule(parent_name) if parent_name else clone
        parent._modules[child] = layer.get_base_layer()
    return clone


def _shallow_module_tree(module: torch.nn.Module) -> torch.nn.Module:
    """Copy the module objects (not their tensors) so children can be swapped without side effects."""
    import copy

    new = copy.copy(module)
    new._modules = {k: _shallow_module_tree(v) if v is not None else None for k, v in module._modules.items()}
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    return new
