"""Static Gaussian parameter noise matched to a 4-bit format's error: the control that tells
"noise" from "4-bit" apart.

Quantization error is a fixed perturbation of the frozen weights. This adds, once, to every Linear
weight (except the skipped ones) i.i.d. Gaussian noise whose Frobenius norm equals that layer's
quantization error ``||W - deq(q(W))||_F`` in the reference format. The model stays full precision;
only the amount of perturbation is the 4-bit one, its structure (rounding to a grid, per-block
scales) is not.
"""

from __future__ import annotations

import math

import torch

from qerl.quant.formats import get_format
from qerl.quant.linear import module_matches


@torch.no_grad()
def add_matched_weight_noise_(
    model: torch.nn.Module, reference_format: str = "nvfp4", seed: int = 0, skip_modules: tuple[str, ...] = ("lm_head",)
) -> dict[str, float]:
    """Perturb every Linear weight in place; returns per-layer relative noise norms."""
    fmt = get_format(reference_format)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    applied: dict[str, float] = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module.weight is None or module_matches(name, skip_modules):
            continue
        if ".lora_" in name:  # adapters are trained, not part of the frozen base
            continue
        w = module.weight
        if not fmt.divides(w.shape[1]):
            continue
        deq = fmt.dequantize(fmt.quantize(w.float()), torch.float32)
        err = float((w.float() - deq).norm())
        noise = torch.randn(w.shape, generator=gen, dtype=torch.float32).to(w.device)
        noise *= err / max(float(noise.norm()), 1e-12)
        w.add_(noise.to(w.dtype))
        applied[name] = err / max(float(w.float().norm()), 1e-12)
    if not applied:
        raise ValueError(f"no Linear layer of {type(model).__name__} could be perturbed")
    return applied


def noise_std_equivalent(rel_error: float, weight_rms: float) -> float:
    """Per-element std of Gaussian noise with relative Frobenius norm ``rel_error``."""
    return rel_error * weight_rms if math.isfinite(rel_error) else float("nan")
