"""One decode step of the ``triton`` backend on static buffers (what the CUDA graph captures).

Per layer: add-RMSNorm (with the previous down output's epilogue) -> q/k/v GEMM (LoRA shrink
alongside) -> RoPE + cache write (q/k/v epilogue) -> attention -> o GEMM (shrink alongside) ->
add-RMSNorm (o epilogue) -> gate/up GEMM (shrink alongside) -> SiLU-mul (gate/up epilogue, down's
shrink) -> down GEMM. Then the final norm, the LM head (torch group path) and sampling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qerl.rollout.fast import kernels as K
from qerl.rollout.fast.plan import Group, Plan
from qerl.rollout.fast.sampling import sample_tokens
from qerl.rollout.fast.state import State, record
from qerl.rollout.fast.torch_forward import TorchContext, group_forward

__all__ = ["step"]


def _shrink(st: State, kind: str, g: Group, x: torch.Tensor) -> torch.Tensor | None:
    """Launch the group's LoRA shrink (on the side stream when there is one)."""
    if not g.r_total:
        return None
    part = st.partials[kind]
    if st.side is None:
        return K.lora_shrink(x, g.a_cat, part)
    st.side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st.side):
        K.lora_shrink(x, g.a_cat, part)
    return part


def _join(st: State, part: torch.Tensor | None) -> None:
    """Make the main stream wait for the side stream's shrink; only after a fork (during graph
    capture, waiting on a side stream that did not fork from the capture invalidates it)."""
    if st.side is not None and part is not None:
        torch.cuda.current_stream().wait_stream(st.side)


def _epilogues(ctx: TorchContext, g: Group, raws: list[torch.Tensor],
               part: torch.Tensor | None, rows: int) -> list[K.Epilogue]:
    gemm = ctx.gemms.get(id(g)) if ctx.gemms else None
    cs = gemm.col_scale if gemm is not None and gemm.uses_humming(rows) else None
    return [K.Epilogue(raw=y, offset=o, col_scale=cs,
                       bias=g.bias,
                       partials=part, lora_b=g.b_full if part is not None else None,
                       rank=g.r_total)
            for o, m, y in zip(g.offsets, g.members, raws, strict=True)]


def _raw(ctx: TorchContext, g: Group, x: torch.Tensor) -> list[torch.Tensor]:
    gemm = ctx.gemms.get(id(g)) if ctx.gemms else None
    if gemm is not None:
        return gemm.raw(x)
    outs = []  # no CUDA group GEMMs (CPU under the Triton interpreter): dequantized copies
    for m in g.members:
        if m.kind == "dense":
            outs.append(F.linear(x, m.weight))
        elif m.kind == "fp4":
            outs.append(F.linear(x, ctx.weight(m, x.dtype)))
        else:
            outs.append(m.module(x).to(x.dtype))
    return outs


def step(plan: Plan, st: State, ctx: TorchContext) -> None:
    """One decode step for all ``st.n_rows`` rows (see the module docstring)."""
    rows = st.n_rows
    h = F.embedding(st.tok, plan.embed)
    prev = None
    for li, lay in enumerate(plan.layers):
        x = K.add_rmsnorm(h, lay.ln1, lay.eps1, prev)
        part = _shrink(st, "qkv", lay.qkv, x)
        q, k, v = _epilogues(ctx, lay.qkv, _raw(ctx, lay.qkv, x), part, rows)
        _join(st, part)
        qr = K.qkv_rope(q, k.raw, v.raw, st.k[li], st.v[li], plan.inv_freq, st.slot, st.pad,
                        plan.rope_scale, plan.n_heads, plan.n_kv, plan.head_dim)
        ao = K.attention(qr, st.k[li], st.v[li], st.slot, st.pad, lay.scaling)
        part = _shrink(st, "o", lay.o, ao)
        (o,) = _epilogues(ctx, lay.o, _raw(ctx, lay.o, ao), part, rows)
        _join(st, part)
        x = K.add_rmsnorm(h, lay.ln2, lay.eps2, o)
        part = _shrink(st, "gu", lay.gu, x)
        g, u = _epilogues(ctx, lay.gu, _raw(ctx, lay.gu, x), part, rows)
        _join(st, part)
        down = lay.down
        dpart = st.partials["down"] if down.r_total else None
        act = K.silu_mul(g, u.raw, down.a_cat if down.r_total else None, dpart)
        (prev,) = _epilogues(ctx, down, _raw(ctx, down, act), dpart, rows)
    x = K.add_rmsnorm(h, plan.norm, plan.norm_eps, prev)
    (logits,) = group_forward(ctx, plan.lm_head, x)
    u = st.u.index_select(0, st.step).squeeze(0)
    record(st, *sample_tokens(logits, u, st.temp, st.top_p, st.mode))
    st.slot.add_(1)
    st.step.add_(1)
