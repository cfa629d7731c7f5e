"""The engine's forward pass in plain torch: prefill on every device, and decode on CPU.

``forward_tokens`` runs tokens ``ids [B, T]`` that occupy cache slots ``start .. start+T-1`` and
returns the last position's logits. Projections run group by group (:func:`group_forward`): the
base through :class:`~qerl.rollout.fast.gemm.GroupGemm` on CUDA (humming / dequantize + cuBLAS)
or a per-call dequantized copy on other devices, then the group's bias and its batched LoRA
(``(x a_cat^T) b_full^T``, one shrink and one expand for the whole group).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from qerl.rollout.fast.gemm import GroupGemm
from qerl.rollout.fast.plan import Group, Member, Plan

__all__ = ["TorchContext", "forward_tokens", "group_forward", "rmsnorm"]


@dataclass
class TorchContext:
    """What a torch forward needs besides the plan: the CUDA group GEMMs (``None`` elsewhere)
    and, off CUDA, the weights dequantized for this ``generate`` call."""

    gemms: dict[int, GroupGemm] | None = None
    deq: dict[int, torch.Tensor] = field(default_factory=dict)

    def weight(self, m: Member, dtype: torch.dtype) -> torch.Tensor:
        w = self.deq.get(id(m))
        if w is None:
            w = self.deq[id(m)] = m.module.dequantize(dtype)
        return w


def rmsnorm(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * (h / rms(h))`` with the normalisation in float32, as transformers' RMSNorm does."""
    hf = h.to(torch.float32)
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return w * hf.to(h.dtype)


def _member_out(ctx: TorchContext, m: Member, x: torch.Tensor) -> torch.Tensor:
    if m.kind == "dense":
        return F.linear(x, m.weight, m.bias)
    if m.kind == "module":
        return m.module(x).to(x.dtype)
    bias = None if m.bias is None else m.bias.to(x.dtype)
    return F.linear(x, ctx.weight(m, x.dtype), bias)


def group_forward(ctx: TorchContext, g: Group, x: torch.Tensor) -> list[torch.Tensor]:
    """The members' outputs ``[..., N_i]`` for input ``x [..., K]``: base + bias + LoRA."""
    gemm = ctx.gemms.get(id(g)) if ctx.gemms is not None else None
    if gemm is not None:
        lead = x.shape[:-1]
        raws = gemm.raw(x.reshape(-1, x.shape[-1]))
        cs = gemm.col_scale if gemm.uses_humming(raws[0].shape[0]) else None
        outs = []
        for o, m, y in zip(g.offsets, g.members, raws, strict=True):
            bias = g.bias[o:o + m.out_f] if g.bias is not None and m.kind != "module" else None
            if cs is not None:  # in float32, one rounding, as the decode epilogue does
                y = y.float() * cs[o:o + m.out_f]
                y = (y if bias is None else y + bias.float()).to(x.dtype)
            elif bias is not None:
                y = y + bias
            outs.append(y.reshape(*lead, m.out_f))
    else:
        outs = [_member_out(ctx, m, x) for m in g.members]
    if g.r_total:
        lora = (x @ g.a_cat.t()) @ g.b_full.t()
        outs = [y + lora[..., o:o + m.out_f]
                for o, m, y in zip(g.offsets, g.members, outs, strict=True)]
    return outs


def _rot_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _rope(plan: Plan, pos: torch.Tensor, dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = pos.to(torch.float32).unsqueeze(-1) * plan.inv_freq.to(torch.float32)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * plan.rope_scale).to(dt), (emb.sin() * plan.rope_scale).to(dt)


def forward_tokens(plan: Plan, ctx: TorchContext, ids: torch.Tensor, start: int,
                   pad: torch.Tensor, kc: list, vc: list) -> torch.Tensor:
    """Run ``ids [B, T]`` in cache slots ``start..start+T-1`` (``pad [B]``: left-pad count of
    each row); fills the caches ``kc``/``vc`` and returns the last position's logits ``[B, V]``."""
    B, T = ids.shape
    Hq, Hkv, D = plan.n_heads, plan.n_kv, plan.head_dim
    S = start + T
    slots = torch.arange(start, S, device=ids.device)
    pos = (slots.unsqueeze(0) - pad.unsqueeze(1)).clamp_min(0)
    cos, sin = (t.unsqueeze(1) for t in _rope(plan, pos, plan.dtype))
    keys = torch.arange(S, device=ids.device).view(1, 1, S)
    allowed = (keys >= pad.view(B, 1, 1)) & (keys <= slots.view(1, T, 1))
    allowed = (allowed | (keys == slots.view(1, T, 1))).unsqueeze(1)  # pads see themselves
    h = F.embedding(ids, plan.embed)
    for li, lay in enumerate(plan.layers):
        x = rmsnorm(h, lay.ln1, lay.eps1)
        q, k, v = group_forward(ctx, lay.qkv, x)
        q = q.view(B, T, Hq, D).transpose(1, 2)
        k = k.view(B, T, Hkv, D).transpose(1, 2)
        v = v.view(B, T, Hkv, D).transpose(1, 2)
        q = q * cos + _rot_half(q) * sin
        k = k * cos + _rot_half(k) * sin
        kc[li][:, :, start:S] = k
        vc[li][:, :, start:S] = v
        K, V = kc[li][:, :, :S], vc[li][:, :, :S]
        if Hkv != Hq:
            K = K.repeat_interleave(Hq // Hkv, dim=1)
            V = V.repeat_interleave(Hq // Hkv, dim=1)
        if ids.is_cuda:
            a = F.scaled_dot_product_attention(q, K, V, attn_mask=allowed, scale=lay.scaling)
        else:
            w = (q @ K.transpose(-1, -2)) * lay.scaling
            w = torch.softmax(w.masked_fill(~allowed, float("-inf")), dim=-1,
                              dtype=torch.float32).to(q.dtype)
            a = w @ V
        (o,) = group_forward(ctx, lay.o, a.transpose(1, 2).reshape(B, T, Hq * D))
        h = h + o
        x = rmsnorm(h, lay.ln2, lay.eps2)
        g, u = group_forward(ctx, lay.gu, x)
        (d,) = group_forward(ctx, lay.down, F.silu(g) * u)
        h = h + d
    (logits,) = group_forward(ctx, plan.lm_head, rmsnorm(h[:, -1], plan.norm, plan.norm_eps))
    return logits
