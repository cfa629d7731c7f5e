"""Stage 2, the quantized model setup: a frozen (quantized) base, its tokenizer and a live LoRA adapter.

``build_policy`` quantizes while loading and wraps the model with peft; ``save_policy`` /
``load_policy`` persist what a later process needs to rebuild the *same* policy without the
original training process (used by single-node reruns): the settings that define it
(``policy.json``: model, quant, lora) and, for our own 4-bit formats, the quantized base in the
compressed-tensors layout (bit-identical on reload).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from qerl.atomic import atomic_directory
from qerl.errors import QerlConfigError
from qerl.kernels import use_backend
from qerl.modeling.loader import load_policy_base, load_quantized, resolve_device, save_quantized
from qerl.modeling.lora import apply_lora
from qerl.quant.formats import FP4_FORMATS
from qerl.train.seeds import derive_seed

if TYPE_CHECKING:
    from qerl.params import LoraParams, ModelParams, QuantParams, TrainParams

SPEC_FILE = "policy.json"


@dataclass
class Policy:
    """A ready-to-train policy. ``model`` is a ``peft.PeftModel``; ``model_settings`` / ``quant`` /
    ``lora`` are the settings it was built from (``qerl.params``)."""

    model: torch.nn.Module
    tokenizer: Any
    model_settings: ModelParams
    quant: QuantParams
    lora: LoraParams
    device: torch.device
    dtype: torch.dtype
    gradient_checkpointing: bool = False

    @property
    def format(self) -> str:
        return self.quant.format

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

    def identity(self) -> dict[str, Any]:
        """What defines this policy's base and adapter shape (compared on single-node reruns)."""
        return {"model": self.model_settings.model_dump(mode="json"), "quant": self.quant.model_dump(mode="json"),
                "lora": self.lora.model_dump(mode="json")}

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if p.requires_grad and "lora_" in n]

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA weights only, under peft's own key names (what adapter_model.safetensors holds)."""
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


def device_of(name: str) -> torch.device:
    """``model.device``: ``auto`` -> CUDA when available, else CPU; otherwise checked as given."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return resolve_device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on GPU, float32 on CPU (CPU bf16 matmuls are slow)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def build_policy(
    model: ModelParams, quant: QuantParams, lora: LoraParams, *, gradient_checkpointing: bool = False,
    seed: int | None = 0,
) -> tuple[Policy, list[dict[str, Any]]]:
    """Load + quantize the base layer by layer, then attach a fresh LoRA adapter (its random
    initialisation drawn from ``seed``). Returns the policy and the per-layer quantization report.
    ``quant.backend`` selects the CUDA FP4 matmul for the process (``qerl.kernels.use_backend``)."""
    use_backend(quant.backend)
    device = device_of(model.device)
    dtype = resolve_dtype(model.dtype, device)
    base, tokenizer, report = load_policy_base(
        model.path, quant.format, device=device, compute_dtype=dtype, bnb_double_quant=quant.bnb_double_quant,
        skip_modules=tuple(quant.skip_modules), on_indivisible=quant.on_indivisible,
    )
    peft_model = apply_lora(base, lora, gradient_checkpointing=gradient_checkpointing, seed=seed).eval()
    return Policy(peft_model, tokenizer, model, quant, lora, device, dtype, gradient_checkpointing), report


def build_policy_for(params: TrainParams) -> tuple[Policy, list[dict[str, Any]]]:
    """:func:`build_policy` from the ``qerl`` settings block (LoRA init seeded from ``rl.seed``)."""
    return build_policy(params.model, params.quant, params.lora, gradient_checkpointing=params.rl.gradient_checkpointing,
                        seed=derive_seed(params.rl.seed, 0, "lora_init"))


def save_policy(policy: Policy, out_dir: str | os.PathLike) -> Path:
    """Write ``policy.json`` (+ the quantized base for nvfp4/mxfp4) atomically into ``out_dir``."""
    out = Path(out_dir)
    with atomic_directory(out) as tmp:
        spec = {**policy.identity(), "gradient_checkpointing": policy.gradient_checkpointing}
        (tmp / SPEC_FILE).write_text(json.dumps(spec, indent=2))
        if policy.format in FP4_FORMATS:
            base = policy.model.get_base_model()
            with policy.model.disable_adapter():
                save_quantized(_without_lora(base), policy.tokenizer, tmp / "base")
    return out


def load_policy(in_dir: str | os.PathLike, seed: int | None = 0) -> Policy:
    """Rebuild a policy saved with :func:`save_policy` (adapter freshly initialised from ``seed``)."""
    from qerl.params import LoraParams, ModelParams, QuantParams

    root = Path(in_dir)
    spec_file = root / SPEC_FILE
    if not spec_file.exists():
        raise QerlConfigError(
            "policy", f"no saved policy at {root}",
            "run `kedro run --pipelines=qerl_train` (its setup_quantized_policy node writes it) first",
        )
    raw = json.loads(spec_file.read_text())
    model, quant, lora = ModelParams(**raw["model"]), QuantParams(**raw["quant"]), LoraParams(**raw["lora"])
    ckpt = bool(raw.get("gradient_checkpointing", False))
    if quant.format in FP4_FORMATS and (root / "base").exists():
        device = device_of(model.device)
        base, tokenizer = load_quantized(root / "base", device=device)
        peft_model = apply_lora(base, lora, gradient_checkpointing=ckpt, seed=seed).eval()
        return Policy(peft_model, tokenizer, model, quant, lora, device, resolve_dtype(model.dtype, device), ckpt)
    return build_policy(model, quant, lora, gradient_checkpointing=ckpt, seed=seed)[0]


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
