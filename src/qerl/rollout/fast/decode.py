"""One decode step of the ``triton`` backend on static buffers (what the CUDA graph captures).

Per layer: add-RMSNorm (with the previous down output's epilogue) -> q/k/v GEMM -> attention
(with the q/k/v epilogue, RoPE and the cache write in its launch) -> o GEMM -> add-RMSNorm (o
epilogue) -> gate/up GEMM -> SiLU-mul (gate/up epilogue) -> down GEMM. Then the final norm, the LM
head (torch group path) and sampling.

LoRA: per group with adapters, ``lo = (x a_cat^T) b_full^T`` into a static buffer: one launch of
the fused kernel (:mod:`qerl.rollout.fast.lora`, up to its rows, on the main stream by default) or
two cuBLAS GEMMs (on a side stream while the main stream runs the group's base GEMM); the
consumer kernel adds ``lo`` in its epilogue (one load per element), after the streams join.
Where the group runs through our FP4 GEMV (one-row waves) and ``st.lora_in_gemv``, its LoRA is
inside the GEMV's launch instead (:mod:`qerl.kernels.fp4_gemv_lora`): no ``lo`` at all.

``st.pdl``: the Triton kernels and humming's GEMMs are launched with programmatic dependent
launch (:mod:`qerl.rollout.fast.pdl`); the embedding, the LM head and sampling are not. With
it, ``st.gemm_sms`` (``FastEngine(lora_sms=...)``) runs each group's fused LoRA at the same time
as its base GEMM, which leaves it that many multiprocessors.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F

from qerl.kernels.dequant import reserve_scratch
from qerl.rollout.fast import attention as A
from qerl.rollout.fast import kernels as K
from qerl.rollout.fast.lora import fused_lora
from qerl.rollout.fast.plan import Group, Plan
from qerl.rollout.fast.sampling import sample_tokens
from qerl.rollout.fast.state import State, record
from qerl.rollout.fast.torch_forward import TorchContext, group_forward

__all__ = ["capture", "step"]


def _lora(st: State, kind: str, g: Group, x: torch.Tensor,
          beside: bool = False) -> torch.Tensor | None:
    """Launch the group's LoRA (shrink, then expand into ``st.lora_out[kind]``) on the side
    stream when there is one; ``None`` for a group without adapters. ``beside``: the fused
    kernel launched right after the group's humming GEMM, to run beside it."""
    if not g.r_total:
        return None
    rows = x.shape[0]
    lo = st.lora_out[kind]
    if st.side is not None:
        st.side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st.side) if st.side is not None else contextlib.nullcontext():
        if st.lora_fused is not None:
            launch, acc, counters = st.lora_fused[kind]
            fused_lora(x, g.a_cat, g.b_full, lo, acc, counters, launch,
                       pdl=st.pdl and st.side is None, beside=beside, end_wait=st.lora_end_wait)
        else:
            xa = st.lora_xa[kind][: rows * g.r_total].view(rows, g.r_total)
            torch.mm(x, g.a_cat.t(), out=xa)
            torch.mm(xa, g.b_full.t(), out=lo)
    return lo


def _join(st: State, lo: torch.Tensor | None) -> None:
    """Make the main stream wait for the side stream's LoRA; only after a fork (during graph
    capture, waiting on a side stream that did not fork from the capture invalidates it)."""
    if st.side is not None and lo is not None:
        torch.cuda.current_stream().wait_stream(st.side)


def _epilogues(ctx: TorchContext, g: Group, raws: list[torch.Tensor], lo: torch.Tensor | None,
               rows: int) -> list[K.Epilogue]:
    gemm = ctx.gemms.get(id(g)) if ctx.gemms else None
    cs = gemm.col_scale if gemm is not None and gemm.uses_humming(rows) else None
    return [K.Epilogue(raw=y, offset=o, col_scale=cs, bias=g.bias, lora=lo)
            for o, y in zip(g.offsets, raws, strict=True)]


def _raw(ctx: TorchContext, g: Group, x: torch.Tensor, pdl: bool = False,
         sms: int | None = None, lora: tuple | None = None) -> list[torch.Tensor]:
    gemm = ctx.gemms.get(id(g)) if ctx.gemms else None
    if gemm is not None:
        return gemm.raw(x, pdl=pdl, sms=sms, lora=lora)
    outs = []  # no CUDA group GEMMs (CPU under the Triton interpreter): dequantized copies
    for m in g.members:
        if m.kind == "dense":
            outs.append(F.linear(x, m.weight))
        elif m.kind == "fp4":
            outs.append(F.linear(x, ctx.weight(m, x.dtype)))
        else:
            outs.append(m.module(x).to(x.dtype))
    return outs


def _finished(st: State, ctx: TorchContext, kind: str, g: Group, x: torch.Tensor,
              rows: int) -> list[K.Epilogue]:
    """The group's base GEMM with its LoRA alongside, as epilogues for the consumer kernel;
    ``st.gemm_sms`` set and the GEMM humming's: the GEMM on that many multiprocessors, then the
    fused LoRA launched beside it (on the others; :func:`qerl.rollout.fast.lora.fused_lora`).
    Other GEMMs (cuBLAS) do not let the next kernel start early: the LoRA goes first."""
    gemm = ctx.gemms.get(id(g)) if ctx.gemms else None
    if st.lora_in_gemv and gemm is not None and gemm.lora_in_gemv(rows):  # one launch for both
        return _epilogues(ctx, g, _raw(ctx, g, x, st.pdl, lora=(g.a_cat, g.b_full)), None, rows)
    sms = gemm.beside_sms(rows, st.gemm_sms) if gemm is not None else None
    if sms is not None:
        raws = _raw(ctx, g, x, st.pdl, sms)
        lo = _lora(st, kind, g, x, beside=True)
    else:
        lo = _lora(st, kind, g, x)
        raws = _raw(ctx, g, x, st.pdl)
    epis = _epilogues(ctx, g, raws, lo, rows)
    _join(st, lo)
    return epis


def step(plan: Plan, st: State, ctx: TorchContext) -> None:
    """One decode step for all ``st.n_rows`` rows (see the module docstring)."""
    rows, pdl = st.n_rows, st.pdl
    h = F.embedding(st.tok, plan.embed)
    prev = None
    for li, lay in enumerate(plan.layers):
        x = K.add_rmsnorm(h, lay.ln1, lay.eps1, prev, pdl=pdl)
        q, k, v = _finished(st, ctx, "qkv", lay.qkv, x, rows)
        ao = A.rope_attention(q, k.raw, v.raw, st.k[li], st.v[li], plan.inv_freq, st.slot,
                              st.pad, plan.rope_scale, plan.n_heads, plan.head_dim, lay.scaling,
                              st.attn_splits, st.attn_cnt, pdl=pdl)
        (o,) = _finished(st, ctx, "o", lay.o, ao, rows)
        x = K.add_rmsnorm(h, lay.ln2, lay.eps2, o, pdl=pdl)
        g, u = _finished(st, ctx, "gu", lay.gu, x, rows)
        act = K.silu_mul(g, u.raw, pdl=pdl)
        (prev,) = _finished(st, ctx, "down", lay.down, act, rows)
    x = K.add_rmsnorm(h, plan.norm, plan.norm_eps, prev, pdl=pdl)
    (logits,) = group_forward(ctx, plan.lm_head, x)
    u = st.u.index_select(0, st.step).squeeze(0)
    record(st, *sample_tokens(logits, u, st.temp, st.top_p, st.mode))
    st.slot.add_(1)
    st.step.add_(1)


def capture(plan: Plan, st: State, ctx: TorchContext, warm: torch.cuda.Stream) -> None:
    """Warm up (compiles the kernels) on stream ``warm`` and capture one decode step as a CUDA
    graph (``warm``: the engine's own, so that no call leaves a new cuBLAS workspace behind)."""
    if ctx.gemms:
        need = max(gm.max_scratch() for gm in ctx.gemms.values())
        reserve_scratch(plan.device, plan.dtype, need)
    saved = st.snapshot()
    try:
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            for _ in range(2):
                st.restore(saved)
                step(plan, st, ctx)
        torch.cuda.current_stream().wait_stream(warm)
        torch.cuda.synchronize()
        st.restore(saved)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step(plan, st, ctx)
        torch.cuda.synchronize()
        st.graph = g
    except Exception as e:  # pragma: no cover - depends on the GPU stack
        warnings.warn(f"fast engine: CUDA graph capture failed ({e!r}); decoding eagerly",
                      stacklevel=4)
        st.graph = None
    finally:
        st.restore(saved)
