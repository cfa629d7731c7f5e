"""L2 prefetch of the next small GEMM's 4-bit weights while the decode step does something else.

At decode row counts humming's GEMMs read their weights at well under the copy bandwidth, the
small ones most (7B q/k/v and o at one row: about 0.7-0.8 TB/s of 3.0 on the H100; 32B at 32
rows: 0.9-1.4 TB/s, docs/benchmarks.md). Between them run kernels that move few bytes (RoPE,
attention, the norms), during which the memory system is mostly idle. This module lets the step
pull a group's weights into L2 ahead of its GEMM with Hopper's bulk prefetch
(``cp.async.bulk.prefetch.L2``: one instruction per chunk, no registers or shared memory, the
kernel exits as soon as the requests are issued), so the GEMM then reads them from L2:

* ``"o"``: the layer's o projection, issued before the attention kernel;
* ``"o+qkv"``: that, and the next layer's q/k/v, issued before the down projection (the first
  layer's before the next step, right after the LM head);
* ``"o+qkv+lora"``: that, and every group's LoRA weights (``a_cat``, ``b_full``) with its base
  weights' (gate/up's before its GEMM, down's with the next q/k/v): the fused LoRA kernel runs
  on a few multiprocessors beside the GEMM, where what bounds it is the latency of its loads.

A group is prefetched only when its weights fit in half the L2 (gate/up and down never do at 7B
and larger). ``policy="evict_last"`` marks the prefetched lines to be evicted last (the KV
cache the attention streams in between would otherwise push them out).

With PDL (:mod:`qerl.rollout.fast.pdl`) the prefetch kernel issues its requests before it waits
for the kernel ahead of it (the weights never change during a rollout), lets the next kernel
launch, then waits, so the stream's order still holds transitively.

The planning (which bytes, in which chunks) is plain Python and tested on CPU; the kernel needs a
compute capability 9.0 GPU and compiled Triton (its PTX is checked in the tests).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import torch

from qerl.rollout.fast.pdl import HAS_TRITON, launch_kw, tl, triton

__all__ = ["CHUNK", "MODES", "POLICIES", "L2Prefetch", "chunks", "plan_prefetch",
           "prefetch_supported", "resolve_mode", "state_prefetches"]

MODES = ("off", "o", "o+qkv", "o+qkv+lora")
POLICIES = ("normal", "evict_last")
CHUNK = 16 << 10  # bytes a bulk prefetch request covers (one per thread)
ALIGN = 16  # the bulk prefetch's address and size granularity
_NT = 32  # threads (= requests) of one program: one warp


def prefetch_supported(device: torch.device) -> bool:
    """Whether the bulk L2 prefetch kernel can run on ``device``: a CUDA GPU of compute
    capability 9.0 or later and compiled Triton (not the interpreter)."""
    if not HAS_TRITON or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def resolve_mode(mode: str, device: torch.device, backend: str) -> str:
    """The engine's ``l2_prefetch`` for ``device`` and decode ``backend``: ``"off"`` as is; any
    other mode needs the ``triton`` backend where :func:`prefetch_supported`, else raises."""
    if mode != "off" and not (backend == "triton" and prefetch_supported(device)):
        raise ValueError(f"l2_prefetch={mode!r} needs the triton backend on a CUDA GPU of compute "
                         f"capability 9.0 or later with compiled Triton; the model is on {device} "
                         f"(backend {backend}): use l2_prefetch='off'")
    return mode


def chunks(regions: Iterable[tuple[int, int]], chunk: int = CHUNK) -> list[tuple[int, int]]:
    """``(address, bytes)`` regions as bulk prefetch requests: each region widened to whole
    ``ALIGN``-byte units (start rounded down, end up; device allocations are at least 512-byte
    aligned, so this never leaves the allocation) and cut into requests of at most ``chunk``
    bytes. Empty regions give no request."""
    if chunk <= 0 or chunk % ALIGN:
        raise ValueError(f"chunk must be a positive multiple of {ALIGN} bytes, got {chunk}")
    out = []
    for addr, nbytes in regions:
        if nbytes <= 0:
            continue
        lo = addr - addr % ALIGN
        hi = -(-(addr + nbytes) // ALIGN) * ALIGN
        out += [(a, min(chunk, hi - a)) for a in range(lo, hi, chunk)]
    return out


def tensor_regions(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """``(data_ptr, bytes)`` of each non-empty tensor."""
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t.numel()]


def plan_prefetch(layers: Sequence, gemms: Mapping[int, object], rows: int, mode: str,
                  max_bytes: int) -> dict[tuple[str, int], list[tuple[int, int]]]:
    """Where the decode step issues which prefetches, for ``mode`` (see the module docstring):
    ``{(point, layer): regions}`` with points ``"attn"`` (before layer ``li``'s attention: its
    o weights), ``"down"`` (before layer ``li``'s down GEMM: layer ``li + 1``'s q/k/v),
    ``"head"`` (after the LM head: layer 0's q/k/v, for the next step) and, with LoRA, ``"gu"``
    (before the gate/up GEMM: its LoRA). ``gemms`` maps ``id(group)`` to an object with
    ``prefetch_tensors(rows)`` (the tensors its GEMM reads at ``rows``; :class:`qerl.rollout.
    fast.gemm.GroupGemm`); a group whose GEMM reads nothing prefetchable there, or more than
    ``max_bytes``, has no base weights prefetched."""
    if mode not in MODES:
        raise ValueError(f"l2_prefetch must be {', '.join(MODES[:-1])} or {MODES[-1]}, got {mode!r}")
    lora = mode == "o+qkv+lora"

    def base(group) -> list[tuple[int, int]]:
        gemm = gemms.get(id(group))
        regs = tensor_regions(gemm.prefetch_tensors(rows)) if gemm is not None else []
        return regs if 0 < sum(n for _, n in regs) <= max_bytes else []

    def adapters(group) -> list[tuple[int, int]]:
        if not (lora and getattr(group, "r_total", 0)):
            return []
        return tensor_regions(t for t in (group.a_cat, group.b_full) if t is not None)

    points: dict[tuple[str, int], list[tuple[int, int]]] = {}
    if mode == "off":
        return points
    for li, lay in enumerate(layers):
        points["attn", li] = base(lay.o) + adapters(lay.o)
        if mode != "o":
            nxt = layers[li + 1] if li + 1 < len(layers) else None
            points["down", li] = (base(nxt.qkv) + adapters(nxt.qkv) if nxt is not None else []) \
                + adapters(lay.down)
            points["gu", li] = adapters(lay.gu)
    if mode != "o" and layers:
        points["head", 0] = base(layers[0].qkv) + adapters(layers[0].qkv)
    return {k: v for k, v in points.items() if v}


if HAS_TRITON:
    from qerl.rollout.fast.pdl import pdl_launch, pdl_wait

    @triton.jit
    def _l2_prefetch_kernel(table_ptr, n_req, NT: tl.constexpr, EVICT_LAST: tl.constexpr,
                            PDL: tl.constexpr):
        """One bulk L2 prefetch per thread: request ``c`` covers ``table[c, 1]`` bytes from
        address ``table[c, 0]``; then, with ``PDL``, the next kernel may launch and this one
        waits for the kernel before it (the order of the stream)."""
        c = tl.program_id(0) * NT + tl.arange(0, NT)
        ok = c < n_req
        addr = tl.load(table_ptr + 2 * c, mask=ok, other=0)
        size = tl.load(table_ptr + 2 * c + 1, mask=ok, other=0).to(tl.int32)
        if EVICT_LAST:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 pol; setp.ne.s32 p, $2, 0; "
                "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; "
                "mov.u32 $0, 0; }",
                "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.s32 p, $2, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
        if PDL:
            pdl_launch()
            pdl_wait()


class L2Prefetch:
    """The requests of one prefetch point on ``device`` (an ``int64 [n, 2]`` table of address and
    size, built once), launched by :meth:`launch`."""

    def __init__(self, regions: Iterable[tuple[int, int]], device: torch.device,
                 policy: str = "normal", chunk: int = CHUNK) -> None:
        if policy not in POLICIES:
            raise ValueError(f"l2_prefetch_policy must be {' or '.join(POLICIES)}, got {policy!r}")
        reqs = chunks(regions, chunk)
        self.n_req = len(reqs)
        self.nbytes = sum(n for _, n in reqs)
        self.policy = policy
        self.table = torch.tensor(reqs or [(0, 0)], dtype=torch.int64).to(device)

    def launch(self, pdl: bool = False) -> None:
        """Issue the prefetches (``pdl``: launched with programmatic dependent launch)."""
        if not self.n_req:
            return
        _l2_prefetch_kernel[(triton.cdiv(self.n_req, _NT),)](
            self.table, self.n_req, NT=_NT, EVICT_LAST=self.policy == "evict_last", num_warps=1,
            **launch_kw(pdl))


def state_prefetches(layers: Sequence, gemms: Mapping[int, object] | None, rows: int, mode: str,
                     policy: str, device: torch.device) -> dict[tuple[str, int], L2Prefetch]:
    """The decode state's prefetches (:func:`plan_prefetch` at ``rows``, groups up to half the
    device's L2), ready to launch; none for ``mode="off"`` or without group GEMMs."""
    if mode == "off" or not gemms:
        return {}
    half_l2 = torch.cuda.get_device_properties(device).L2_cache_size // 2
    return {k: L2Prefetch(v, device, policy)
            for k, v in plan_prefetch(layers, gemms, rows, mode, half_l2).items()}
