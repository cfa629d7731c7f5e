"""Where the 4-bit weights live during a rollout: once on the GPU, not twice.

humming's GEMMs run on their own prepared copy of each 4-bit weight (:mod:`qerl.kernels.
humming_gemm`), while the trainer's forward and backward dequantize the compressed-tensors
buffers of the ``QuantLinear`` layers. Keeping both on the GPU doubles the 4-bit weight memory
(32B: +18 GiB). With the engine's ``single_copy`` option, :class:`HostParking` moves the trainer's
buffers of every group that humming runs into pinned host memory for the length of a rollout,
group by group as humming's copies are made (so the peak never holds both), and brings them back
afterwards, after humming's copies are freed. The tensors keep their identity (``.data`` is
swapped), so modules, peft and optimizers see the same objects; only their storage moves. The
host buffers are kept and reused by the next rollout (and dropped with their tensor).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["HostParking", "park_group"]


class HostParking:
    """Pinned host copies of device tensors, swapped in and out by storage (see the module doc)."""

    def __init__(self) -> None:
        self._host: dict[int, torch.Tensor] = {}  # id(tensor) -> host buffer, dropped with the tensor
        self._parked: list[tuple[torch.Tensor, torch.device]] = []

    @property
    def host_buffers(self) -> int:
        """Reusable host buffers held (one per live tensor ever parked)."""
        return len(self._host)

    @property
    def parked(self) -> int:
        """Tensors currently on the host."""
        return len(self._parked)

    def nbytes(self) -> int:
        """Bytes currently parked on the host."""
        return sum(t.numel() * t.element_size() for t, _ in self._parked)

    def park(self, tensors: list[torch.Tensor]) -> None:
        """Move ``tensors`` to host memory (a tensor already parked is left as is)."""
        pin = torch.cuda.is_available()
        parked = {id(p) for p, _ in self._parked}
        for t in tensors:
            if id(t) in parked:
                continue
            parked.add(id(t))
            host = self._host.get(id(t))
            if host is None or host.shape != t.shape or host.dtype != t.dtype:
                if host is None:
                    weakref.finalize(t, self._host.pop, id(t), None)
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                self._host[id(t)] = host
            host.copy_(t.data)
            self._parked.append((t, t.device))
            t.data = host
        if pin:
            torch.cuda.synchronize()

    def restore(self) -> None:
        """Bring every parked tensor back to the device it came from (fresh device storage)."""
        while self._parked:
            t, dev = self._parked.pop()
            back = torch.empty(t.shape, dtype=t.dtype, device=dev)
            back.copy_(t.data, non_blocking=True)
            t.data = back
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def park_group(parking: HostParking, group) -> None:
    """Park the 4-bit buffers of a plan group's members, and drop any humming copy a member's
    ``QuantLinear`` cached for its own small-M forward (``kernel_cache``), so that no second copy
    survives the rollout on the trainer's side either."""
    tensors = []
    for m in group.members:
        cache = getattr(m.module, "kernel_cache", None)
        if cache is not None:
            cache.clear()
        tensors += [t for t in m.fp4_tensors() if t is not None]
    parking.park(tensors)
