"""LoRA adapters on top of the frozen (quantized or not) policy base, through stock peft.

Every base format works with the same call: plain ``nn.Linear`` (``none``), bitsandbytes
``Linear4bit`` (``nf4`` / ``fp4``) and our ``QuantLinear`` (``nvfp4`` / ``mxfp4``, which peft wraps
like an ``nn.Linear``; see :mod:`qerl.quant.linear`). Target module names are checked against the
model before anything is wrapped.

Default dropout is 0: in RL the rollout policy samples in eval mode, and adapter dropout in the
trainer's forward would make trainer log-probs differ from rollout log-probs for no benefit.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from qerl.errors import QerlConfigError

if TYPE_CHECKING:
    from qerl.params import LoraParams

__all__ = ["apply_lora", "check_lora_targets", "is_bnb_quantized", "to_peft_config"]

def to_peft_config(lora: LoraParams) -> Any:
    """The ``peft.LoraConfig`` of the ``lora`` settings, for a causal LM."""
    from peft import LoraConfig

    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), bias=lora.bias, task_type="CAUSAL_LM")


def _matches(module_name: str, target: str) -> bool:
    """peft's rule for a list of target names: the full name, or its dotted suffix."""
    return module_name == target or module_name.endswith("." + target)


def _linear_leaf_names(model: nn.Module) -> list[str]:
    return sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and isinstance(m, nn.Linear)}
    )


def check_lora_targets(model: nn.Module, targets: Iterable[str]) -> None:
    """Raise ``QerlConfigError`` (``lora.target_modules``) if a target matches no module."""
    names = [n for n, _ in model.named_modules() if n]
    missing = [t for t in targets if not any(_matches(n, t) for n in names)]
    if missing:
        raise QerlConfigError(
            "lora.target_modules",
            f"{missing} match no module of this {type(model).__name__}",
            f"choose among the model's linear layers: {_linear_leaf_names(model)}",
        )


def is_bnb_quantized(model: nn.Module) -> bool:
    """Whether ``model`` contains bitsandbytes 4-bit or 8-bit linear layers."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return False
    kinds = (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)
    return any(isinstance(m, kinds) for m in model.modules())


def _enable_checkpointing(model: nn.Module, kwargs: dict[str, Any]) -> None:
    """Turn on activation checkpointing (transformers >= 5.2x name first, then the old one)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]


def apply_lora(
    model: nn.Module,
    lora: LoraParams | None = None,
    *,
    gradient_checkpointing: bool = False,
    adapter_name: str = "default",
    seed: int | None = None,
) -> Any:
    """Wrap ``model`` with LoRA adapters (peft ``get_peft_model``) and return the ``PeftModel``.

    Only adapter parameters are trainable afterwards. For bitsandbytes models peft's
    ``prepare_model_for_kbit_training`` runs first (it freezes the base and upcasts the small
    full-precision parts to fp32); other formats need no preparation. Gradient checkpointing
    (non-reentrant) is enabled only when asked for. With ``seed`` the adapter's random initialisation
    (LoRA ``A``) is drawn from that seed on a private generator, so two runs with the same seed start
    from bitwise equal adapters whatever the global RNG state was.
    """
    from peft import get_peft_model, prepare_model_for_kbit_training

    if lora is None:
        from qerl.params import LoraParams

        lora = LoraParams()
    check_lora_targets(model, lora.target_modules)
    ckpt_kwargs = {"use_reentrant": False}
    if is_bnb_quantized(model):
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs=ckpt_kwargs,
        )
    elif gradient_checkpointing:
        _enable_checkpointing(model, ckpt_kwargs)
    if seed is None:
        return get_peft_model(model, to_peft_config(lora), adapter_name=adapter_name)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return get_peft_model(model, to_peft_config(lora), adapter_name=adapter_name)
