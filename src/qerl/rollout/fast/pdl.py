"""Programmatic dependent launch (PDL; Hopper and later) for the decode step's kernels.

A kernel launched with PDL (CUDA's programmatic stream serialization; Triton's ``launch_pdl``)
may start while the kernel before it on the stream is still running. Its programs first wait
for that kernel to finish (``griddepcontrol.wait``, which also makes its writes visible), then
let the next kernel launch (``griddepcontrol.launch_dependents``). Every kernel launched this
way waits before it touches memory, so the order of the stream holds transitively; what is
saved is the launch latency and ramp-up of each kernel boundary (humming's GEMMs do the same
with ``use_pdl``). The fused LoRA kernel has a second mode, beside the group's GEMM
(:func:`qerl.rollout.fast.lora.fused_lora`).
"""

from __future__ import annotations

import os

import torch

try:  # the fast engine's Triton import (qerl.rollout.fast.kernels re-exports it)
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - pragma: no cover - depends on the machine
    triton = tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "launch_kw", "pdl_supported"]


def pdl_supported(device: torch.device) -> bool:
    """Whether the decode kernels can use PDL on ``device``: a CUDA GPU of compute capability
    9.0 or later, compiled Triton (not the interpreter) whose launcher takes ``launch_pdl``, and
    ``QERL_PDL`` not set to ``0`` / ``off`` / ``false``."""
    if not HAS_TRITON or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if os.environ.get("QERL_PDL", "").strip().lower() in ("0", "off", "false", "no"):
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # noqa: BLE001 - pragma: no cover - another Triton backend
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields and torch.cuda.get_device_capability(device)[0] >= 9


def launch_kw(pdl: bool) -> dict:
    """The launch options of a kernel launched with (``pdl``) or without PDL; the kernel gets
    ``PDL=pdl`` too, so it waits for the kernel before it."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


if HAS_TRITON:

    @triton.jit
    def pdl_wait():
        """``griddepcontrol.wait``: the kernel before this one has finished and its writes are
        visible."""
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def pdl_launch():
        """``griddepcontrol.launch_dependents``: the next kernel may launch (once every program
        of this one has said so or finished)."""
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """First thing in a kernel launched with PDL: wait for the kernel before it, then let
        the next one launch. Nothing when ``PDL`` is false."""
        if PDL:
            pdl_wait()
            pdl_launch()
