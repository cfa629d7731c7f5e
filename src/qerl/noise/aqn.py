"""Adaptive Quantization Noise (AQN) injection into the RMSNorm weights of a causal LM.

Paper section 3.3: a noise vector ``Z ~ N(0, sigma^2 I_d)`` added to the weight of an RMSNorm scales
every input channel of the linears that norm feeds, i.e. it is row-wise multiplicative noise on
those (quantized) weights -- without touching the 4-bit kernels and without extra parameters:

- ``input_layernorm`` feeds ``q_proj`` / ``k_proj`` / ``v_proj``;
- ``post_attention_layernorm`` feeds ``gate_proj`` / ``up_proj`` (Qwen2, Llama, Mistral, Qwen3...).

Targets are found by **attribute name**, walking the module tree, never by class name: the paper's
released code matched transformers class names inside vLLM's model (which has its own norm class)
and so injected nothing. A "decoder layer" is any module with an ``input_layernorm`` child; its MLP
norm is ``pre_feedforward_layernorm`` when the layer has one (Gemma 2/3, whose
``post_attention_layernorm`` normalises the attention *output* and feeds no linear), else
``post_attention_layernorm``. Works the same on a bare model, a peft ``PeftModel`` and models with
any kind of quantized linear (only the norms are touched).

Usage (rollout only; noise is re-drawn every step and the clean weights always come back)::

    with aqn_noise(model, schedule.sigma(step), noise_generator(cfg.seed, step)) as info:
        rollouts = engine.generate(...)
    # info.num_modules, info.changed_fraction -> metrics

Precision caveat: the noise is added in the weight's own dtype. Norm weights near 1 stored in bf16
have a spacing of 2^-8..2^-7, so sigma ~ 5e-4 mostly rounds away; ``AqnInfo.changed_fraction``
reports how many elements actually changed. Pure torch; no Kedro.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from qerl.errors import QerlConfigError

ATTENTION_NORM = "input_layernorm"
"""Child name of the norm feeding q/k/v; also what marks a module as a decoder layer."""

MLP_NORMS: tuple[str, ...] = ("pre_feedforward_layernorm", "post_attention_layernorm")
"""Child names of the norm feeding gate/up, in order of preference."""

_ACTIVE_WEIGHTS: set[int] = set()
"""ids of norm weights currently noised by an ``aqn_noise`` block (nesting would stack noise, so it
is refused -- also when entered once through a PeftModel and once through its base model)."""


@dataclass(frozen=True)
class AqnInfo:
    """What one ``aqn_noise`` entry did.

    Attributes:
        sigma: the noise standard deviation.
        num_modules: number of norm weights noised (0 when sigma is 0).
        module_names: their qualified names.
        num_elements: total number of weight elements noised.
        changed_fraction: fraction of those elements whose stored value actually changed (below 1
            when low-precision rounding swallowed part of the noise; 0 when sigma is 0).
    """

    sigma: float
    num_modules: int
    module_names: tuple[str, ...]
    num_elements: int
    changed_fraction: float


def find_aqn_targets(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The norm weights AQN perturbs, as ``(qualified module name, weight)`` pairs, model order.

    For every module with an ``input_layernorm`` child: that norm (feeds q/k/v) and the MLP input
    norm (``pre_feedforward_layernorm`` if present, else ``post_attention_layernorm``; feeds
    gate/up). Norms without a 1-D floating-point ``weight`` are skipped; a weight shared by two
    names is returned once.
    """
    targets: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for layer_name, layer in model.named_modules():
        if not isinstance(getattr(layer, ATTENTION_NORM, None), nn.Module):
            continue
        child_names = [ATTENTION_NORM]
        for mlp_norm in MLP_NORMS:
            if isinstance(getattr(layer, mlp_norm, None), nn.Module):
                child_names.append(mlp_norm)
                break
        for child_name in child_names:
            weight = getattr(getattr(layer, child_name), "weight", None)
            if not isinstance(weight, torch.Tensor) or weight.dim() != 1 \
                    or not weight.is_floating_point() or id(weight) in seen:
                continue
            seen.add(id(weight))
            targets.append((f"{layer_name}.{child_name}" if layer_name else child_name, weight))
    return targets


def noise_generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from ``(seed, step)``: a fresh, reproducible draw for every step.

    Resuming at ``step`` reproduces the noise an uninterrupted run would have drawn there.
    """
    generator = torch.Generator(device=device)
    generator.manual_seed((int(seed) * 1_000_003 + int(step)) % (2**63 - 1))
    return generator


@contextmanager
def aqn_noise(
    model: nn.Module,
    sigma: float,
    generator: torch.Generator | None = None,
) -> Iterator[AqnInfo]:
    """Add fresh ``N(0, sigma^2)`` noise to every AQN target norm weight for the ``with`` body.

    Each target gets its own independent draw of size ``hidden`` (drawn in float32 on the
    generator's device, added to the weight in float32 and written back in place in the weight's
    dtype). On exit --
    also on an exception -- every weight is restored bit for bit from a clone taken on entry, so
    noise never accumulates across entries. ``sigma == 0`` changes nothing (the targets are still
    looked up, so a model AQN cannot handle fails at once, not at the first noisy stage).

    Args:
        model: a Qwen2/Llama-style causal LM, possibly wrapped in a peft ``PeftModel``.
        sigma: noise standard deviation, finite and >= 0.
        generator: source of randomness (e.g. ``noise_generator(seed, step)``); ``None`` uses
            torch's global RNG.

    Yields:
        ``AqnInfo`` describing what was noised.

    Raises:
        QerlConfigError: negative or non-finite sigma, no target norm in the model, or the model
            already inside ``aqn_noise``.
    """
    if not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma < 0:
        raise QerlConfigError("noise.sigma", f"must be a finite number >= 0, got {sigma!r}",
                              "check the noise schedule (noise.sigma_start / noise.sigma_end)")
    targets = find_aqn_targets(model)
    if not targets:
        raise QerlConfigError(
            "model", f"AQN found no target norm in {type(model).__name__} (looked for decoder "
            f"layers with an '{ATTENTION_NORM}' child and its "
            f"'{MLP_NORMS[1]}' / '{MLP_NORMS[0]}' sibling)",
            "use a Qwen2/Llama-style model, or set noise.schedule to 'none'")
    if sigma == 0:
        yield AqnInfo(sigma=0.0, num_modules=0, module_names=(), num_elements=0,
                      changed_fraction=0.0)
        return
    ids = {id(weight) for _, weight in targets}
    if ids & _ACTIVE_WEIGHTS:
        raise QerlConfigError("model", f"{type(model).__name__} is already inside aqn_noise",
                              "leave the outer aqn_noise block before entering a new one")

    originals: list[torch.Tensor] = []
    _ACTIVE_WEIGHTS.update(ids)
    try:
        changed = 0
        total = 0
        with torch.no_grad():
            for _, weight in targets:
                original = weight.detach().clone()
                originals.append(original)
                device = generator.device if generator is not None else torch.device("cpu")
                z = torch.randn(weight.shape, generator=generator, dtype=torch.float32,
                                device=device).mul_(sigma)
                # Sum in float32, round once to the weight's dtype.
                weight.copy_(original.to(torch.float32) + z.to(weight.device))
                changed += int((weight != original).sum().item())
                total += weight.numel()
        yield AqnInfo(sigma=float(sigma), num_modules=len(targets),
                      module_names=tuple(name for name, _ in targets), num_elements=total,
                      changed_fraction=changed / total if total else 0.0)
    finally:
        with torch.no_grad():
            for (_, weight), original in zip(targets, originals, strict=False):
                weight.copy_(original)
        _ACTIVE_WEIGHTS.difference_update(ids)
