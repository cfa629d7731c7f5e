"""Data parallelism under ``torchrun``: N processes (one a GPU, or CPU processes with gloo) train one
adapter, exactly as one process would on the same global batch.

Each rank generates and scores a contiguous shard of every step's prompts (:func:`shard`; whole
groups: a group never spans ranks, so the group advantages stay local). The update sums what the
loss normalisation needs over the ranks (the generation batch's token count, the minibatch's
sequence count), every rank accumulates the gradient of its own rows, and one all-reduce of the LoRA
gradients (:func:`all_reduce_grads`, the LoRA parameters only) gives every rank the gradient of the
whole batch before the optimizer step, so all ranks apply the same update. The metrics row is
reduced (:func:`gather_frames`, :func:`all_sum`, :func:`all_max`, :func:`reduce_stats`), and only rank
0 writes (:func:`is_main`: checkpoints, the catalog, logs).

Everything here is the identity when ``torch.distributed`` is not initialised (the single-process
loop runs the same code) and works with gloo (CPU) and NCCL (CUDA) alike.
"""

from __future__ import annotations

import io
import logging
import os
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from qerl.errors import QerlConfigError

if TYPE_CHECKING:
    from collections.abc import Iterable

#: NVLink multicast stays off (NCCL, PyTorch symmetric memory, NVSHMEM): on shared NVLink hosts a
#: program that uses it can put the GPUs out of service (the device docs require these).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------ who am I


def initialized() -> bool:
    """True inside an initialised process group."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank: the process group's, or before it exists the launcher's ``RANK`` (0 alone)."""
    return dist.get_rank() if initialized() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """Processes in the group (1 without one)."""
    return dist.get_world_size() if initialized() else 1


def is_main() -> bool:
    """Rank 0: the only process that writes checkpoints, catalog entries and logs."""
    return rank() == 0


def init_from_env() -> bool:
    """Join the process group ``torchrun`` describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
    ``MASTER_ADDR``/``MASTER_PORT``): NCCL with one GPU per local rank when CUDA is there, else gloo.
    Sets :data:`NO_MULTICAST` first (over any other value) and lowers the other ranks' console
    logging to warnings. Returns whether a group is active; a no-op without ``torchrun`` or when
    already initialised."""
    os.environ.update(NO_MULTICAST)
    if initialized() or "WORLD_SIZE" not in os.environ or not dist.is_available():
        return initialized()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    if not is_main():
        for name in ("", "qerl", "kedro"):
            logger = logging.getLogger(name)
            logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    log.info("data parallel: %d ranks (%s)", world_size(), dist.get_backend())
    return True


def close() -> None:
    """Wait for every rank, then leave the process group (a no-op without one), so no rank tears
    its connections down while another still talks to it. The Kedro session calls it after a
    successful run; a script that drives ``train`` under ``torchrun`` ends with it: a gloo group
    left to the interpreter's exit can abort a rank ("terminate called without an active
    exception") after its peer has gone. A failed run does not call it: leaving a group while the
    other ranks wait in a collective can hang them, and ``torchrun`` stops them once the failed
    rank has exited."""
    if not initialized():
        return
    dist.barrier()
    dist.destroy_process_group()


def check_world(prompts_per_step: int, device: str) -> None:
    """Refuse, before any work, a run that ``world_size()`` ranks cannot share."""
    n = world_size()
    if n == 1:
        return
    if prompts_per_step < n:
        raise QerlConfigError("qerl.rl.prompts_per_step", f"is {prompts_per_step} but torchrun started {n} ranks "
                              "(each rank generates whole prompt groups)",
                              f"use at least {n} prompts per step (a multiple of {n} balances the ranks)")
    if device.startswith("cuda:"):
        raise QerlConfigError("qerl.model.device", f"is {device!r} but each of the {n} ranks uses its own GPU "
                              "(cuda:LOCAL_RANK)", "use auto or cuda")


# ------------------------------------------------------------------------------------ sharding


def shard_bounds(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous slice ``[lo, hi)`` of ``n`` items among ``world`` ranks (in rank order;
    the first ``n % world`` ranks get one more)."""
    size, extra = divmod(n, world)
    lo = rank * size + min(rank, extra)
    return lo, lo + size + int(rank < extra)


def shard(n: int) -> tuple[int, int]:
    """This rank's slice of ``n`` items (all of them without a process group)."""
    return shard_bounds(n, dist.get_rank(), dist.get_world_size()) if initialized() else (0, n)


def local_indices(index: Iterable[int], counts: list[int]) -> list[int]:
    """The entries of a global row index that this rank holds, as its local row numbers (rank r holds
    the global rows ``sum(counts[:r]) .. sum(counts[:r+1]) - 1``, in order)."""
    lo = sum(counts[: rank()]) if initialized() else 0
    hi = lo + counts[rank() if initialized() else 0]
    return [i - lo for i in index if lo <= i < hi]


# ------------------------------------------------------------------------------------ reductions


def _device() -> torch.device:
    """Where collectives' tensors live: this rank's GPU for NCCL, the CPU for gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(values: dict[str, float], op: dist.ReduceOp) -> dict[str, float]:
    if world_size() == 1 or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=op)
    return dict(zip(keys, t.tolist(), strict=True))


def all_sum(values: dict[str, float]) -> dict[str, float]:
    """Each value summed over the ranks (one collective for the whole dict)."""
    return _all_reduce(values, dist.ReduceOp.SUM)


def all_max(values: dict[str, float]) -> dict[str, float]:
    """Each value's maximum over the ranks."""
    return _all_reduce(values, dist.ReduceOp.MAX)


def any_rank(flag: bool) -> bool:
    """True when ``flag`` is true on any rank (e.g. a non-finite loss: every rank then skips the step)."""
    return bool(all_max({"flag": float(flag)})["flag"])


def all_gather_counts(n: int) -> list[int]:
    """``[n of rank 0, n of rank 1, ...]``."""
    if world_size() == 1:
        return [n]
    t = torch.tensor([n], dtype=torch.long, device=_device())
    out = [torch.zeros_like(t) for _ in range(world_size())]
    dist.all_gather(out, t)
    return [int(x) for x in out]


def reduce_stats(stats: dict[str, float], weight: float) -> dict[str, float]:
    """Statistics each rank computed over its own ``weight`` items (e.g. tokens), combined: keys ending
    in ``_max`` the maximum (a rank with no items gives none), every other key the weighted mean."""
    maxima = {k: (v if weight > 0 else -np.inf) for k, v in stats.items() if k.endswith("_max")}
    means = {k: v * weight for k, v in stats.items() if k not in maxima}
    sums = all_sum({**means, "__weight": weight})
    total = sums.pop("__weight")
    out = {k: v / total if total > 0 else stats[k] for k, v in sums.items()}
    out.update({k: (v if np.isfinite(v) else stats[k]) for k, v in all_max(maxima).items()})
    return {k: out[k] for k in stats}


def gather_frames(frame: pd.DataFrame) -> pd.DataFrame:
    """Every rank's ``frame``, concatenated in rank order (``frame`` itself without a group). Sent as
    parquet bytes: exact values, any column type, nothing unpickled."""
    if world_size() == 1:
        return frame
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
    sizes = all_gather_counts(len(payload))
    t = torch.zeros(max(sizes), dtype=torch.uint8, device=_device())
    t[: len(payload)] = payload.to(t.device)
    parts = [torch.zeros_like(t) for _ in sizes]
    dist.all_gather(parts, t)
    frames = [pd.read_parquet(io.BytesIO(p[:n].cpu().numpy().tobytes())) for p, n in zip(parts, sizes, strict=True)]
    return pd.concat(frames, ignore_index=True)


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients of ``params`` (the LoRA parameters) over the ranks, in place: one flat
    all-reduce per dtype. A parameter without a gradient on this rank (no rows) contributes zeros."""
    if world_size() == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads]).to(_device())
        dist.all_reduce(flat)
        for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(part.view_as(g))


def barrier() -> None:
    """Wait for every rank (e.g. until rank 0 has finished writing what the others read next)."""
    if world_size() > 1:
        dist.barrier()


def check_same(value: float, field: str, problem: str, fix: str) -> None:
    """Refuse to go on when ranks disagree on ``value`` (e.g. the step a resume starts from)."""
    if world_size() == 1:
        return
    lo, hi = -all_max({"v": -float(value)})["v"], all_max({"v": float(value)})["v"]
    if lo != hi:
        raise QerlConfigError(field, f"{problem}: rank {rank()} has {value}, the ranks range over {lo}..{hi}", fix)


def agreed(flag: bool, field: str, fix: str) -> bool:
    """``flag``, checked to be the same on every rank (a loop condition, a skip decision)."""
    check_same(float(flag), field, "the ranks disagree", fix)
    return flag
