"""bitsandbytes 4-bit (``nf4`` / ``fp4``): the loader's config, per-layer quantization, CPU fix.

bitsandbytes is imported lazily, only when one of its formats is asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from qerl.errors import QerlConfigError

__all__ = [
    "BNB_FORMATS",
    "bnb_config",
    "bnb_linear4bit",
    "keep_bnb_weights_trainable",
    "require_bitsandbytes",
]

BNB_FORMATS: tuple[str, ...] = ("nf4", "fp4")


def require_bitsandbytes(fmt: str) -> None:
    """Raise a clear error when ``fmt`` needs bitsandbytes and it cannot be imported."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise QerlConfigError(
            "quant.format",
            f"{fmt!r} needs bitsandbytes, which cannot be imported ({exc})",
            "install bitsandbytes or choose nvfp4 / mxfp4 / none",
        ) from None


def bnb_config(
    fmt: str, dtype: torch.dtype, double_quant: bool, skip_modules: Iterable[str]
) -> Any:
    """transformers' ``BitsAndBytesConfig`` for ``fmt`` (quantized while the checkpoint loads)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=fmt,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=dtype,
        llm_int8_skip_modules=list(skip_modules),
    )


def bnb_linear4bit(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    *,
    compute_dtype: torch.dtype,
    double_quant: bool = True,
    device: torch.device | str | None = None,
) -> nn.Module:
    """A bitsandbytes ``Linear4bit`` quantizing ``weight [out, in]`` on ``device`` (one layer).

    The same layer (``quant_storage`` uint8, block size 64) transformers builds for a
    ``BitsAndBytesConfig`` load; ``weight`` is not kept. The CPU repacking that breaks training
    is switched off (see :func:`keep_bnb_weights_trainable`).
    """
    import bitsandbytes as bnb

    target = torch.device(device) if device is not None else weight.device
    out_features, in_features = weight.shape
    layer = bnb.nn.Linear4bit(
        in_features,
        out_features,
        bias=bias is not None,
        compute_dtype=compute_dtype,
        compress_statistics=double_quant,
        quant_type=fmt,
        quant_storage=torch.uint8,
        device="meta",
    )
    layer.weight = bnb.nn.Params4bit(
        weight.detach(),
        requires_grad=False,
        compress_statistics=double_quant,
        quant_type=fmt,
        quant_storage=torch.uint8,
        module=layer,
    ).to(target)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().to(target), requires_grad=False)
    layer.support_avx512bf16_for_cpu = False
    return layer


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
