"""A group's LoRA in decode as one kernel launch: ``lo = (x a_cat^T) b_full^T``.

The two-GEMM path (cuBLAS shrink, split-K reduce, expand: three launches a group, eight small
GEMMs a decoder layer) is latency-bound at decode batch sizes: each launch is a few microseconds
of mostly idle multiprocessors (docs/benchmarks.md: about 1 ms a 7B step at B=64 and B=1). Here one
launch does both halves, for up to :data:`MAX_ROWS` rows; the engine uses it up to
:data:`FUSED_MAX_M` rows, where it measured faster than the cuBLAS pair:

* every program first takes a ticket (an atomic counter), so tickets follow the order in which
  programs actually started;
* the first ``split`` tickets each compute the shrink over one slice of 128 (or 256) input
  features, add it into a float32 ``[M, R]`` accumulator (atomic adds) and count themselves done
  (release);
* the other tickets each own ``BLOCK_N`` output columns: they wait until all shrink tickets are
  done (acquire), read the rank slice of the accumulator their columns use (``b_full`` is block
  diagonal: a tile inside one member reads only that member's rank slice), round it to the model
  dtype (where the cuBLAS path rounds its shrink output) and write ``xa_slice b_tile^T``;
* the last program to finish clears the accumulator and puts the counters back to zero for the
  next launch (CUDA-graph replays included).

Every program is one load round trip plus a few atomics: the first version looped over 512- to
2,048-feature slices in each shrink program and was slower than cuBLAS at every batch (run 20).

A waiting program only waits for tickets handed out before its own, to programs already running,
so the launch cannot deadlock whatever the grid size or what else shares the GPU.
"""

from __future__ import annotations

import warnings

import torch

from qerl.rollout.fast.kernels import HAS_TRITON, np2, tl, triton

__all__ = ["FUSED_MAX_M", "MAX_ROWS", "LoraLaunch", "fused_lora", "fused_lora_ok", "lora_torch"]

# Rows the kernel takes (its shrink holds all rows in one block).
MAX_ROWS = 64
# Rows up to which the engine uses it instead of the cuBLAS pair. Runs 21-23 (docs/benchmarks.md),
# ms a decode step, fused vs the pair: 7B B=1 3.83 vs 3.92; 7B B=8 4.66 vs 4.61, 32B B=32 16.92 vs
# 16.30, 7B B=64 5.70 vs 5.56: ahead only at batch 1.
FUSED_MAX_M = 1
BLOCK_N = 128
_OK: dict = {}


def lora_torch(x: torch.Tensor, a_cat: torch.Tensor, b_full: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: two GEMMs, the shrink rounded to the model dtype (the cuBLAS path)."""
    xa = x @ a_cat.t()
    if out is None:
        return xa @ b_full.t()
    return torch.mm(xa, b_full.t(), out=out)


def tile_rank_starts(out_f: list[int], ranks: list[int], block_n: int) -> tuple[list[int], int]:
    """Per output tile of ``block_n`` columns, the first column of ``b_full`` it reads, and the
    width of the rank window every tile reads. A tile inside one member reads that member's rank
    slice (``b_full`` is block diagonal, so the window's other columns are zero on its rows);
    when some tile straddles two members every tile reads all ``sum(ranks)`` columns."""
    r_total = sum(ranks)
    n = sum(out_f)
    starts, col_ends, r = [], [], 0
    for f, rk in zip(out_f, ranks, strict=True):
        starts.append(r)
        col_ends.append((col_ends[-1] if col_ends else 0) + f)
        r += rk
    tiles = -(-n // block_n)
    firsts = []
    for t in range(tiles):
        lo, hi = t * block_n, min(n, (t + 1) * block_n) - 1
        mem_lo = next(i for i, e in enumerate(col_ends) if lo < e)
        mem_hi = next(i for i, e in enumerate(col_ends) if hi < e)
        if mem_lo != mem_hi:
            return [0] * tiles, max(16, np2(r_total))
        firsts.append(starts[mem_lo])
    return firsts, max(16, np2(max(ranks)))


class LoraLaunch:
    """What one group's fused launch needs besides its tensors: tile rank starts (a device
    tensor), the rank window and the shrink split (from the input features)."""

    def __init__(self, out_f: list[int], ranks: list[int], in_f: int, device: torch.device) -> None:
        firsts, self.window = tile_rank_starts(out_f, ranks, BLOCK_N)
        self.r0 = torch.tensor(firsts, dtype=torch.int32, device=device)
        self.n_tiles = len(firsts)
        self.r_total = sum(ranks)
        # one load per shrink program: 128-feature slices, 256 for the wide down projections
        self.k_per = 128 if in_f <= 8192 else 256
        self.split = -(-in_f // self.k_per)

    def acc_numel(self, rows: int) -> int:
        """Float32 accumulator values a launch of ``rows`` rows needs (zero before the first)."""
        return rows * self.r_total


def fused_lora(x: torch.Tensor, a_cat: torch.Tensor, b_full: torch.Tensor, out: torch.Tensor,
               acc: torch.Tensor, counters: torch.Tensor, launch: LoraLaunch) -> torch.Tensor:
    """``out [M, N] = (x a_cat^T) b_full^T`` in one launch; ``acc``: float32 zeros, at least
    ``launch.acc_numel(M)``; ``counters``: 3 int32 zeros. Both are left zero by the launch, for
    the next one (launches sharing them must not run concurrently: one set per stream)."""
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"fused_lora takes at most {MAX_ROWS} rows, got {m}")
    n, r = b_full.shape
    if x.stride(1) != 1 or not (a_cat.is_contiguous() and b_full.is_contiguous()):
        raise ValueError("fused_lora needs row-major x (unit column stride), a_cat and b_full")
    dt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]
    grid = (launch.split + launch.n_tiles,)
    _lora_kernel[grid](x, x.stride(0), a_cat, b_full, acc, out, out.stride(0), counters, launch.r0,
                       m, k, r, n, launch.split,
                       BM=max(16, np2(m)), BK=launch.k_per, BR=max(16, np2(r)), RS=launch.window,
                       BN=BLOCK_N, DT=dt, num_warps=4)
    return out


def fused_lora_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Once per device and dtype: the kernel agrees with :func:`lora_torch` on a random group of
    three members (and leaves its counters and accumulator at zero); else a warning and the
    cuBLAS path."""
    key = (device, dtype)
    if key not in _OK:
        try:
            g = torch.Generator(device=device).manual_seed(0)
            out_f, ranks, k, m = [384, 128, 128], [8, 8, 8], 1100, 5
            x = torch.randn(m, k, device=device, generator=g).to(dtype)
            a = (torch.randn(sum(ranks), k, device=device, generator=g) * 0.05).to(dtype)
            b = torch.zeros(sum(out_f), sum(ranks), device=device, dtype=dtype)
            ro = co = 0
            for f, rk in zip(out_f, ranks, strict=True):
                b[co:co + f, ro:ro + rk] = (torch.randn(f, rk, device=device, generator=g) * 0.1).to(dtype)
                ro, co = ro + rk, co + f
            lau = LoraLaunch(out_f, ranks, k, device)
            acc = torch.zeros(lau.acc_numel(m), device=device)
            cnt = torch.zeros(3, dtype=torch.int32, device=device)
            out = torch.full((m, sum(out_f)), float("nan"), device=device, dtype=dtype)
            for _ in range(2):  # the second launch needs the counters the first reset
                fused_lora(x, a, b, out, acc, cnt, lau)
            ref = lora_torch(x.float(), a.float(), b.float())
            err = float((out.float() - ref).norm() / ref.norm())
            if not err < 2e-2 or int(cnt.abs().sum()) != 0 or bool(acc.any()):
                raise RuntimeError(f"relative error {err:.3g}, counters {cnt.tolist()}, "
                                   f"accumulator cleared: {not bool(acc.any())}")
            _OK[key] = True
        except Exception as e:  # noqa: BLE001 - pragma: no cover - depends on the GPU stack
            warnings.warn(f"fast engine: the fused LoRA kernel failed its check for {dtype} ({e!r});"
                          " LoRA runs as cuBLAS GEMMs", stacklevel=3)
            _OK[key] = False
    return _OK[key]


if HAS_TRITON:

    @triton.jit
    def _lora_kernel(x_ptr, sx, a_ptr, b_ptr, acc_ptr, lo_ptr, slo, cnt_ptr, r0_ptr, M, K, R, N,
                     SPLIT, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                     RS: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr):
        rows = tl.arange(0, BM)
        rmask = rows < M
        t = tl.atomic_add(cnt_ptr, 1)  # the ticket
        if t < SPLIT:  # shrink: features [t * BK, (t + 1) * BK), added into acc [M, R]
            rr = tl.arange(0, BR)
            rk = rr < R
            offs = t * BK + tl.arange(0, BK)
            km = offs < K
            xt = tl.load(x_ptr + rows[:, None] * sx + offs[None, :],
                         mask=rmask[:, None] & km[None, :], other=0.0)
            at = tl.load(a_ptr + rr[:, None] * K + offs[None, :], mask=rk[:, None] & km[None, :],
                         other=0.0)
            part = tl.dot(xt, tl.trans(at))
            tl.atomic_add(acc_ptr + rows[:, None] * R + rr[None, :], part,
                          mask=rmask[:, None] & rk[None, :], sem="relaxed")
            tl.debug_barrier()  # every thread's additions before the one release below
            tl.atomic_add(cnt_ptr + 1, 1, sem="release")
        else:  # expand: columns [tile * BN, (tile + 1) * BN)
            tile = t - SPLIT
            done = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire")
            while done < SPLIT:
                done = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire")
            rs = tl.load(r0_ptr + tile) + tl.arange(0, RS)
            rsm = rs < R
            xa = tl.load(acc_ptr + rows[:, None] * R + rs[None, :],
                         mask=rmask[:, None] & rsm[None, :], other=0.0, cache_modifier=".cg")
            cols = tile * BN + tl.arange(0, BN)
            cm = cols < N
            b = tl.load(b_ptr + cols[:, None] * R + rs[None, :], mask=cm[:, None] & rsm[None, :],
                        other=0.0)
            y = tl.dot(xa.to(DT), tl.trans(b))
            tl.store(lo_ptr + rows[:, None] * slo + cols[None, :], y.to(DT),
                     mask=rmask[:, None] & cm[None, :])
        fin = tl.atomic_add(cnt_ptr + 2, 1, sem="acq_rel")
        if fin == SPLIT + tl.cdiv(N, BN) - 1:  # the last one out clears acc and the counters
            rz = tl.arange(0, BR)
            tl.store(acc_ptr + rows[:, None] * R + rz[None, :], tl.zeros((BM, BR), tl.float32),
                     mask=rmask[:, None] & (rz < R)[None, :])
            tl.debug_barrier()
            tl.atomic_xchg(cnt_ptr, 0)
            tl.atomic_xchg(cnt_ptr + 1, 0)
            tl.atomic_xchg(cnt_ptr + 2, 0, sem="release")
