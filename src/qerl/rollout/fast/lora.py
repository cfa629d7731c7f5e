"""A group's LoRA in decode as one kernel launch: ``lo = (x a_cat^T) b_full^T``.

The two-GEMM path (cuBLAS shrink, split-K reduce, expand: three launches a group, eight small
GEMMs a decoder layer) is latency-bound at decode batch sizes: each launch is a few microseconds
of mostly idle multiprocessors (docs/benchmarks.md: about 1 ms a 7B step at B=64 and B=1). Here one
launch does both halves, for up to :data:`MAX_ROWS` rows; the engine uses it up to
:data:`FUSED_MAX_M` rows, where it measured faster than the cuBLAS pair:

* every program first takes a ticket from a 64-bit counter that only ever grows (one per group
  kind, so every launch on it has the same ``P`` programs): ticket ``t`` is local ticket
  ``t mod P`` of launch ``t div P``, and local tickets follow the order in which programs
  actually started;
* the accumulator is two float32 ``[M, R]`` buffers, used by alternate launches;
* the first ``split`` local tickets each compute the shrink over one slice of 128 (or 256) input
  features and add it into the launch's buffer (atomic adds), clear their share of the other
  buffer (the previous launch's: launches on one stream run one after the other, so all its
  readers are done) and count themselves done (release);
* the other tickets each own ``BLOCK_N`` output columns: they load their ``b_full`` tile, wait
  until the done count reaches ``split`` times the launches so far (acquire), read the rank
  slice of the buffer their columns use (``b_full`` is block diagonal: a tile inside one member
  reads only that member's rank slice), round it to the model dtype (where the cuBLAS path rounds
  its shrink output) and write ``xa_slice b_tile^T``.

Nothing is reset at the end of a launch, so no program waits for the others to finish (the
second version ended with a last-finisher reset of the counters and the buffer; runs 20-25).

Every program is one load round trip plus a few atomics: the first version looped over 512- to
2,048-feature slices in each shrink program and was slower than cuBLAS at every batch (run 20).

A waiting program only waits for tickets handed out before its own, to programs already running,
so the launch cannot deadlock whatever else shares the GPU, provided the counters' launches run
one at a time (one stream) and all have the same programs (one counter set per group kind and row
count; :func:`fused_lora` checks the shapes against the launch). With programmatic dependent
launch (``pdl``) they still do: a launch of a kind and the next one of that kind have other
kernels between them, each of which waits for the one before it to finish before it lets the
next one start; beside the GEMM (``beside``) the programs also wait at their end, for the GEMM
only, which never waits for them.
"""

from __future__ import annotations

import warnings

import torch

from qerl.rollout.fast.kernels import HAS_TRITON, np2, tl, triton
from qerl.rollout.fast.options import choice
from qerl.rollout.fast.pdl import launch_kw

__all__ = ["FUSED_MAX_M", "MAX_ROWS", "LoraLaunch", "fused_lora", "fused_lora_ok", "lora_torch"]

# Rows the kernel takes (its shrink holds all rows in one block).
MAX_ROWS = 64
# Rows up to which the engine uses it instead of the cuBLAS pair: every row count it takes. Run 27
# (docs/benchmarks.md), ms a 7B decode step, this version vs the pair: B=1 3.84 vs 3.90, B=8 5.16
# vs 5.24, B=64 5.36 vs 5.44 (the second version, runs 21-23, was ahead only at B=1).
FUSED_MAX_M = 64
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
        """Float32 accumulator values a launch of ``rows`` rows needs (two buffers; zeros before
        the first launch)."""
        return 2 * rows * self.r_total

    def programs(self) -> int:
        """Programs (tickets) a launch takes."""
        return self.split + self.n_tiles


def fused_lora(x: torch.Tensor, a_cat: torch.Tensor, b_full: torch.Tensor, out: torch.Tensor,
               acc: torch.Tensor, counters: torch.Tensor, launch: LoraLaunch,
               pdl: bool = False, beside: bool = False,
               end_wait: str = "one") -> torch.Tensor:
    """``out [M, N] = (x a_cat^T) b_full^T`` in one launch; ``acc``: float32, at least
    ``launch.acc_numel(M)``, and ``counters``: int64 ``[2]``, both zeros before their first launch
    and then only ever passed to launches of the same ``launch`` and ``M``, one at a time (one
    stream): each launch leaves them as the next one needs them. ``pdl``: launched with
    programmatic dependent launch (:mod:`qerl.rollout.fast.pdl`; without ``beside``, every
    program waits for the kernel before it before it takes its ticket). ``beside`` (with
    ``pdl``): launched right after the group's humming GEMM, which lets it launch as soon as the
    GEMM has started (humming triggers its dependants after its own wait), so the two run at once
    (on the multiprocessors the GEMM leaves free, see ``FastEngine(lora_sms=...)``): the
    programs do not wait at their start (``x`` is complete: the GEMM started only after the
    kernel that wrote it finished; it is read at L2) but at their end, so that this kernel
    finishes after the GEMM and its consumer, which waits for this kernel only, sees both
    outputs. ``end_wait``: ``"one"`` (the first ticket's program waits at its end: the launch
    still finishes only after the GEMM, and the other programs free their slots as they finish;
    faster in run 40 of docs/benchmarks.md) or ``"all"`` programs wait."""
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"fused_lora takes at most {MAX_ROWS} rows, got {m}")
    n, r = b_full.shape
    if x.stride(1) != 1 or not (a_cat.is_contiguous() and b_full.is_contiguous()):
        raise ValueError("fused_lora needs row-major x (unit column stride), a_cat and b_full")
    if counters.dtype != torch.int64 or counters.numel() < 2:
        raise ValueError("fused_lora needs int64 counters [2]")
    # the ticket protocol needs every launch on these counters to have this launch's programs
    if (r != launch.r_total or -(-n // BLOCK_N) != launch.n_tiles
            or -(-k // launch.k_per) != launch.split):
        raise ValueError(f"fused_lora: x [{m}, {k}] / b_full [{n}, {r}] do not match the launch "
                         f"({launch.split} shrink slices, {launch.n_tiles} tiles, rank "
                         f"{launch.r_total})")
    if beside and not pdl:
        raise ValueError("fused_lora: beside=True needs pdl=True")
    choice("end_wait", end_wait, ("one", "all"))
    if acc.numel() < launch.acc_numel(m):
        raise ValueError(f"fused_lora: acc holds {acc.numel()} values, {launch.acc_numel(m)} needed")
    dt = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[x.dtype]
    grid = (launch.split + launch.n_tiles,)
    _lora_kernel[grid](x, x.stride(0), a_cat, b_full, acc, out, out.stride(0), counters, launch.r0,
                       m, k, r, n, launch.split,
                       BM=max(16, np2(m)), BK=launch.k_per, BR=max(16, np2(r)), RS=launch.window,
                       BN=BLOCK_N, ZB=max(16, np2(-(-m * r // launch.split))), DT=dt, num_warps=4,
                       BESIDE=beside, ONE_WAITER=end_wait == "one", **launch_kw(pdl))
    return out


def fused_lora_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Once per device and dtype: the kernel agrees with :func:`lora_torch` on a random group of
    three members, twice (the second launch on the first's counters and buffers); else a warning
    and the cuBLAS path."""
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
            cnt = torch.zeros(2, dtype=torch.int64, device=device)
            ref = lora_torch(x.float(), a.float(), b.float())
            errs = []
            for _ in range(2):  # the second launch runs on the state the first left
                out = torch.full((m, sum(out_f)), float("nan"), device=device, dtype=dtype)
                fused_lora(x, a, b, out, acc, cnt, lau)
                errs.append(float((out.float() - ref).norm() / ref.norm()))
            want = [2 * lau.programs(), 2 * lau.split]
            nxt = acc[: m * sum(ranks)]  # the buffer a third launch would add into
            if not max(errs) < 2e-2 or cnt.tolist() != want or bool(nxt.any()):
                raise RuntimeError(f"relative errors {errs}, counters {cnt.tolist()} (want {want}), "
                                   f"next buffer cleared: {not bool(nxt.any())}")
            _OK[key] = True
        except Exception as e:  # noqa: BLE001 - pragma: no cover - depends on the GPU stack
            warnings.warn(f"fast engine: the fused LoRA kernel failed its check for {dtype} ({e!r});"
                          " LoRA runs as cuBLAS GEMMs", stacklevel=3)
            _OK[key] = False
    return _OK[key]


if HAS_TRITON:
    from qerl.rollout.fast.pdl import pdl_launch, pdl_wait

    @triton.jit
    def _lora_kernel(x_ptr, sx, a_ptr, b_ptr, acc_ptr, lo_ptr, slo, cnt_ptr, r0_ptr, M, K, R, N,
                     SPLIT, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                     RS: tl.constexpr, BN: tl.constexpr, ZB: tl.constexpr, DT: tl.constexpr,
                     PDL: tl.constexpr, BESIDE: tl.constexpr, ONE_WAITER: tl.constexpr):
        if PDL:
            if not BESIDE:
                pdl_wait()  # before the ticket: the previous launch on these counters is done
            pdl_launch()
        rows = tl.arange(0, BM)
        rmask = rows < M
        t = tl.atomic_add(cnt_ptr, 1)  # the ticket (int64: it only ever grows)
        progs = SPLIT + tl.cdiv(N, BN)
        launch = t // progs
        lt = t - launch * progs  # the ticket within this launch
        mr = M * R
        cur = acc_ptr + (launch % 2) * mr  # this launch's buffer
        if lt < SPLIT:  # shrink: features [lt * BK, (lt + 1) * BK), added into cur [M, R]
            rr = tl.arange(0, BR)
            rk = rr < R
            offs = lt * BK + tl.arange(0, BK)
            km = offs < K
            if BESIDE:  # x comes from the kernel before the GEMM: read at L2, not a stale L1
                xt = tl.load(x_ptr + rows[:, None] * sx + offs[None, :],
                             mask=rmask[:, None] & km[None, :], other=0.0, cache_modifier=".cg")
            else:
                xt = tl.load(x_ptr + rows[:, None] * sx + offs[None, :],
                             mask=rmask[:, None] & km[None, :], other=0.0)
            at = tl.load(a_ptr + rr[:, None] * K + offs[None, :], mask=rk[:, None] & km[None, :],
                         other=0.0)
            part = tl.dot(xt, tl.trans(at))
            tl.atomic_add(cur + rows[:, None] * R + rr[None, :], part,
                          mask=rmask[:, None] & rk[None, :], sem="relaxed")
            # clear this ticket's share of the other buffer, which the next launch adds into
            share = tl.cdiv(mr, SPLIT)
            z = lt * share + tl.arange(0, ZB)
            tl.store(acc_ptr + (1 - launch % 2) * mr + z, tl.zeros((ZB,), tl.float32),
                     mask=(tl.arange(0, ZB) < share) & (z < mr))
            tl.debug_barrier()  # every thread's additions before the one release below
            tl.atomic_add(cnt_ptr + 1, 1, sem="release")
        else:  # expand: columns [tile * BN, (tile + 1) * BN)
            tile = lt - SPLIT
            rs = tl.load(r0_ptr + tile) + tl.arange(0, RS)
            rsm = rs < R
            cols = tile * BN + tl.arange(0, BN)
            cm = cols < N
            # the b tile does not depend on the shrink: loaded before the wait, so its memory
            # latency overlaps the shrink programs' work
            b = tl.load(b_ptr + cols[:, None] * R + rs[None, :], mask=cm[:, None] & rsm[None, :],
                        other=0.0)
            want = (launch + 1) * SPLIT  # every shrink of this launch and of the ones before
            done = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire")
            while done < want:
                done = tl.atomic_add(cnt_ptr + 1, 0, sem="acquire")
            xa = tl.load(cur + rows[:, None] * R + rs[None, :],
                         mask=rmask[:, None] & rsm[None, :], other=0.0, cache_modifier=".cg")
            y = tl.dot(xa.to(DT), tl.trans(b))
            tl.store(lo_ptr + rows[:, None] * slo + cols[None, :], y.to(DT),
                     mask=rmask[:, None] & cm[None, :])
        if PDL:
            if BESIDE:  # finish after the GEMM launched before this kernel: the consumer waits
                if ONE_WAITER:  # only for this kernel, and reads both outputs; one waiting
                    if lt == 0:  # program is enough for that, and the others free their slots
                        pdl_wait()
                else:
                    pdl_wait()
