"""Devices and compute dtypes of the policy base (fields ``model.device`` / ``model.compute_dtype``)."""

from __future__ import annotations

import torch

from qerl.errors import QerlConfigError

__all__ = ["DTYPE_ALIASES", "dtype_name", "resolve_compute_dtype", "resolve_device"]

DTYPE_ALIASES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


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
        if compute_dtype in DTYPE_ALIASES.values():
            return compute_dtype
    elif str(compute_dtype).removeprefix("torch.") in DTYPE_ALIASES:
        return DTYPE_ALIASES[str(compute_dtype).removeprefix("torch.")]
    raise QerlConfigError(
        "model.compute_dtype",
        f"unsupported dtype {compute_dtype!r}",
        "use one of float32, bfloat16, float16",
    )


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
