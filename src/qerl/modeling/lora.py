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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from qerl.errors import QerlConfigError

__all__ = [
    "ALL_PROJECTIONS",
    "LoraSettings",
    "apply_lora",
    "check_lora_targets",
    "is_bnb_quantized",
]

ALL_PROJECTIONS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
_BIAS_CHOICES = ("none", "all", "lora_only")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA hyper-parameters (``lora.*``).

    The defaults suit the tiny embedded model (r=16, alpha=32 on all seven projections);
    :meth:`paper` is the QeRL paper's setting (r=32, alpha=64).
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ALL_PROJECTIONS
    bias: str = "none"

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, str) or not isinstance(self.target_modules, Sequence):
            raise QerlConfigError(
                "lora.target_modules",
                f"expected a list of module names, got {self.target_modules!r}",
                "e.g. [q_proj, v_proj]",
            )
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if not self.target_modules or not all(
            isinstance(t, str) and t for t in self.target_modules
        ):
            raise QerlConfigError(
                "lora.target_modules",
                f"must be a non-empty list of names, got {list(self.target_modules)!r}",
                f"e.g. {list(ALL_PROJECTIONS)}",
            )
        if not isinstance(self.r, int) or self.r < 1:
            raise QerlConfigError(
                "lora.r", f"rank must be a positive integer, got {self.r!r}", "use e.g. 16 or 32"
            )
        if not self.alpha > 0:
            raise QerlConfigError(
                "lora.alpha", f"must be positive, got {self.alpha!r}", "use e.g. 2 * r"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise QerlConfigError(
                "lora.dropout",
                f"must be in [0, 1), got {self.dropout!r}",
                "use 0.0 (recommended for RL) or e.g. 0.05",
            )
        if self.bias not in _BIAS_CHOICES:
            raise QerlConfigError(
                "lora.bias", f"unknown value {self.bias!r}", f"use one of {list(_BIAS_CHOICES)}"
            )

    @classmethod
    def paper(cls) -> LoraSettings:
        """The QeRL paper's LoRA: rank 32, alpha 64, on q, k, v, o, gate, up and down projections."""
        return cls(r=32, alpha=64, dropout=0.0, target_modules=ALL_PROJECTIONS)

    def to_peft_config(self) -> Any:
        """The equivalent ``peft.LoraConfig`` for a causal LM."""
        from peft import LoraConfig

        return LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            bias=self.bias,
            task_type="CAUSAL_LM",
        )


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
    settings: LoraSettings | None = None,
    *,
    gradient_checkpointing: bool = False,
    adapter_name: str = "default",
) -> Any:
    """Wrap ``model`` with LoRA adapters (peft ``get_peft_model``) and return the ``PeftModel``.

    Only adapter parameters are trainable afterwards. For bitsandbytes models peft's
    ``prepare_model_for_kbit_training`` runs first (it freezes the base and upcasts the small
    full-precision parts to fp32); other formats need no preparation. Gradient checkpointing
    (non-reentrant) is enabled only when asked for.
    """
    from peft import get_peft_model, prepare_model_for_kbit_training

    settings = settings or LoraSettings()
    check_lora_targets(model, settings.target_modules)
    ckpt_kwargs = {"use_reentrant": False}
    if is_bnb_quantized(model):
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs=ckpt_kwargs,
        )
    elif gradient_checkpointing:
        _enable_checkpointing(model, ckpt_kwargs)
    return get_peft_model(model, settings.to_peft_config(), adapter_name=adapter_name)
