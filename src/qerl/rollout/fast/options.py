"""Checks of the fast engine's options: each bad value is a ``ValueError`` that names the option
and what it accepts, raised before any work."""

from __future__ import annotations

import torch

from qerl.rollout.fast.pdl import pdl_supported

__all__ = ["beside_gemm_sms", "bool_or_none", "check_budget", "choice", "int_in", "resolve_pdl"]


def choice(name: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {value!r}")


def int_in(name: str, value, hi: int, lo: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an int in {lo}..{hi}, got {value!r}")


def bool_or_none(name: str, value, none_means: str = "automatic") -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be True, False or None ({none_means}), got {value!r}")


def check_budget(kv_budget_gib: float | None, kv_budget_fraction: float) -> None:
    """The memory budget of a wave (:func:`qerl.rollout.fast.state.wave_rows`)."""
    if kv_budget_gib is not None and not kv_budget_gib > 0:
        raise ValueError(f"kv_budget_gib must be > 0 (or None), got {kv_budget_gib}")
    if not 0 < kv_budget_fraction <= 1:
        raise ValueError(f"kv_budget_fraction must be in (0, 1], got {kv_budget_fraction}")


def resolve_pdl(requested: bool | None, device: torch.device) -> bool:
    """``pdl`` of the engine for ``device``: ``None`` uses programmatic dependent launch where
    :func:`qerl.rollout.fast.pdl.pdl_supported`; ``True`` where it is not raises."""
    bool_or_none("pdl", requested)
    if requested is None:
        return pdl_supported(device)
    if requested and not pdl_supported(device):
        raise ValueError(f"pdl=True needs a CUDA GPU of compute capability 9.0 or later and "
                         f"compiled Triton with launch_pdl (QERL_PDL not 0); the model is on "
                         f"{device}: use pdl=None (automatic) or pdl=False")
    return requested


def beside_gemm_sms(st, lora_sms: int, device: torch.device) -> int | None:
    """Multiprocessors humming's decode GEMMs get when the fused LoRA runs beside them: all but
    ``lora_sms``, where that applies to state ``st`` (PDL on, the fused kernel on the main
    stream) and at least one is left to the GEMM; else ``None`` (the LoRA before the GEMM)."""
    if not (st.pdl and lora_sms and st.lora_fused is not None and st.side is None):
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count - lora_sms
    return sms if sms > 0 else None
