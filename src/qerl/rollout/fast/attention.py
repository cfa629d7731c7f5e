"""Decode attention of the fast engine's ``triton`` backend: one kernel a layer, RoPE in it.

Program ``(b, kh, s)`` takes row ``b``'s query heads of KV head ``kh`` over split ``s`` of the
row's filled cache slots ``pad[b] .. slot`` (flash-decoding: an online softmax over blocks of
``BL`` slots). With more than one split, each program writes its running max, sum and
unnormalised output, counts itself on the ``(b, kh)`` counter, and the last of the splits merges
them (and resets the counter): no second kernel.

:func:`rope_attention` takes the q/k/v GEMM's raw outputs: each program finishes them (the group
epilogue: column scale, bias, LoRA) and rotates its own query heads in registers, and the split
that holds ``slot`` finishes, rotates and writes the new K/V there first. Against a RoPE kernel
before the attention (the engine's path until run 85 of docs/benchmarks.md): one launch a layer
fewer and the rotated queries never in memory (H100, NVFP4 + LoRA, ms a step: 7B B=1 3.11 ->
3.05, B=64 4.53 -> 4.45; 32B B=32 11.71 -> 11.58, run 86).
"""

from __future__ import annotations

import torch

from qerl.rollout.fast.kernels import Epilogue, _epi_args, _flags, np2
from qerl.rollout.fast.pdl import HAS_TRITON, launch_kw, tl, triton

__all__ = ["attention_splits", "rope_attention"]

# cache slots a block of the online softmax; launched with 4 warps and 2 stages (7B, 256 slots,
# H100, run 86 of docs/benchmarks.md: 15.9 us a layer at 64 rows against 17.6 with 3 stages, 16.0
# with 32 slots a block, 19.6-20.9 with 128 or 8 warps; 5.2 against 5.6 at one row)
BL = 64
# capacity a split at least: one block. With the merge inside the kernel, 7B B=1 at 384 slots ran
# 2.96 ms a step with 6 splits against 3.05 with one (NVFP4 + LoRA, H100, run 85 of
# docs/benchmarks.md); with a second kernel merging them, splits below 256 slots gained nothing
MIN_SPLIT_SLOTS = BL


def attention_splits(rows: int, n_kv: int, cap: int, sms: int) -> int:
    """Splits of each row's KV slots: 1 while ``rows * n_kv`` programs fill the ``sms``
    multiprocessors, else enough for about two waves (at most 32, and at least
    ``MIN_SPLIT_SLOTS`` slots of capacity a split)."""
    if rows * n_kv >= sms:
        return 1
    return max(1, min(-(-2 * sms // (rows * n_kv)), cap // MIN_SPLIT_SLOTS, 32))


if HAS_TRITON:
    from qerl.rollout.fast.kernels import _epi_at
    from qerl.rollout.fast.pdl import pdl_enter

    @triton.jit
    def _rotated(raw, lo, col, gcol, m, cos, sin, cs_ptr, b_ptr, HALF: tl.constexpr,
                 HAS_CS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                 DT: tl.constexpr):
        """Finished GEMM outputs at columns ``col`` (a member's; ``gcol`` the group's) of one
        row, rotated: ``x * cos + partner(x) * sin``, the partner of feature ``d`` of a head
        ``d + HALF`` below ``HALF`` (``sin`` negated there by the caller) and ``d - HALF`` above."""
        d = col % (2 * HALF)
        shift = tl.where(d < HALF, HALF, -HALF)
        x = _epi_at(raw + col, m, cs_ptr + gcol, b_ptr + gcol, m, lo + gcol, HAS_CS, HAS_BIAS,
                    HAS_LORA, DT)
        xp = _epi_at(raw + col + shift, m, cs_ptr + gcol + shift, b_ptr + gcol + shift, m,
                     lo + gcol + shift, HAS_CS, HAS_BIAS, HAS_LORA, DT)
        return (x * cos + xp * sin).to(DT)

    @triton.jit
    def _attn_kernel(q_ptr, sq, k_ptr, v_ptr, sk, sv, cs_ptr, b_ptr, lo_ptr, slo, kc_ptr, vc_ptr,
                     skb, skh, skl, invf_ptr, slot_ptr, pad_ptr, rope_scale, qk_scale, o_ptr, so,
                     pacc_ptr, pm_ptr, pl_ptr, cnt_ptr, HQ: tl.constexpr, HKV: tl.constexpr,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                     BL: tl.constexpr, S: tl.constexpr, HAS_CS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, PDL: tl.constexpr):
        """See the module docstring: ``q_ptr`` / ``k_ptr`` / ``v_ptr`` are the raw q/k/v outputs
        (``q`` the group's epilogue member)."""
        pdl_enter(PDL)
        b = tl.program_id(0)
        kh = tl.program_id(1)
        sp = tl.program_id(2)
        b64 = b.to(tl.int64)
        dt = kc_ptr.dtype.element_ty
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, DP)
        offs_l = tl.arange(0, BL)
        dmask = offs_d < D
        qmask = (offs_g[:, None] < G) & dmask[None, :]
        qh = kh * G + offs_g  # this program's query heads
        slot = tl.load(slot_ptr)
        padb = tl.load(pad_ptr + b)
        first = (padb // BL) * BL
        per = tl.cdiv(tl.cdiv(slot + 1 - first, BL), S) * BL  # slots of one split
        lo = first + sp * per
        hi = tl.minimum(lo + per, slot + 1)
        kbase = kc_ptr + b64 * skb + kh * skh
        vbase = vc_ptr + b64 * skb + kh * skh
        half: tl.constexpr = D // 2
        j = offs_d % half
        f = (slot - padb).to(tl.float32) * tl.load(invf_ptr + j, mask=dmask, other=0.0)
        cos = tl.cos(f) * rope_scale
        sin = tl.where(offs_d < half, -1.0, 1.0) * tl.sin(f) * rope_scale
        lrow = lo_ptr + b64 * slo
        if (slot >= lo) & (slot < hi):  # this split holds the new slot: finish and write it
            col = kh * D + offs_d
            kr = _rotated(k_ptr + b64 * sk, lrow, col, HQ * D + col, dmask, cos, sin, cs_ptr,
                          b_ptr, half, HAS_CS, HAS_BIAS, HAS_LORA, dt)
            vf = _epi_at(v_ptr + b64 * sv + col, dmask, cs_ptr + (HQ + HKV) * D + col,
                         b_ptr + (HQ + HKV) * D + col, dmask, lrow + (HQ + HKV) * D + col,
                         HAS_CS, HAS_BIAS, HAS_LORA, dt)
            tl.store(kbase + slot.to(tl.int64) * skl + offs_d, kr, mask=dmask)
            tl.store(vbase + slot.to(tl.int64) * skl + offs_d, vf.to(dt), mask=dmask)
        tl.debug_barrier()  # the block loads below read it back (other threads' stores)
        qcol = qh[:, None] * D + offs_d[None, :]
        q = _rotated(q_ptr + b64 * sq, lrow, qcol, qcol, qmask, cos[None, :], sin[None, :],
                     cs_ptr, b_ptr, half, HAS_CS, HAS_BIAS, HAS_LORA, dt)
        m_i = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GP,), dtype=tl.float32)
        acc = tl.zeros((GP, DP), dtype=tl.float32)
        for start in range(lo, hi, BL):
            ll = start + offs_l
            lmask = ll < hi
            kv_mask = lmask[:, None] & dmask[None, :]
            k = tl.load(kbase + ll[:, None] * skl + offs_d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(vbase + ll[:, None] * skl + offs_d[None, :], mask=kv_mask, other=0.0)
            sc = tl.dot(q, tl.trans(k)) * qk_scale  # (v loaded with k: one round trip a block)
            sc = tl.where(((ll >= padb) & lmask)[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            p = tl.exp2(sc - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        ocol = b64 * so + qh[:, None] * D + offs_d[None, :]
        if S == 1:
            tl.store(o_ptr + ocol, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty), mask=qmask)
        else:
            gm = offs_g < G
            prow = (b64 * HQ + qh) * S  # partials [M, HQ, S] and [M, HQ, S, D], float32
            tl.store(pm_ptr + prow + sp, m_i, mask=gm)
            tl.store(pl_ptr + prow + sp, l_i, mask=gm)
            tl.store(pacc_ptr + (prow + sp)[:, None] * D + offs_d[None, :], acc, mask=qmask)
            tl.debug_barrier()  # every thread's partials stored before the release below
            cnt = cnt_ptr + b * HKV + kh
            if tl.atomic_add(cnt, 1, sem="acq_rel") == S - 1:  # the last split: merge
                m_all = tl.full((GP,), float("-inf"), dtype=tl.float32)
                l_all = tl.zeros((GP,), dtype=tl.float32)
                a_all = tl.zeros((GP, DP), dtype=tl.float32)
                for s2 in range(S):  # read at L2: other programs wrote them
                    ms = tl.load(pm_ptr + prow + s2, mask=gm, other=float("-inf"),
                                 cache_modifier=".cg")
                    ls = tl.load(pl_ptr + prow + s2, mask=gm, other=0.0, cache_modifier=".cg")
                    a_s = tl.load(pacc_ptr + (prow + s2)[:, None] * D + offs_d[None, :],
                                  mask=qmask, other=0.0, cache_modifier=".cg")
                    mn = tl.maximum(m_all, ms)  # empty splits have max -inf and weigh nothing
                    w_old = tl.where(m_all > float("-inf"), tl.exp2(m_all - mn), 0.0)
                    w_new = tl.where(ms > float("-inf"), tl.exp2(ms - mn), 0.0)
                    l_all = l_all * w_old + ls * w_new
                    a_all = a_all * w_old[:, None] + a_s * w_new[:, None]
                    m_all = mn
                tl.store(o_ptr + ocol, (a_all / l_all[:, None]).to(o_ptr.dtype.element_ty),
                         mask=qmask)
                tl.atomic_xchg(cnt, 0)  # ready for the next launch


def rope_attention(q: Epilogue, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor,
                   vc: torch.Tensor, inv_freq: torch.Tensor, slot: torch.Tensor, pad: torch.Tensor,
                   rope_scale: float, n_heads: int, head_dim: int, scaling: float,
                   splits: int = 1, counters: torch.Tensor | None = None,
                   pdl: bool = False, tune: dict | None = None) -> torch.Tensor:
    """One decode step's attention of a layer: ``q`` describes the q/k/v group's epilogue (its raw
    output the q member's), ``k`` / ``v`` are the other members' raw outputs; writes the rotated K
    and V at cache slot ``slot`` of ``kc`` / ``vc [M, KV heads, slots, D]`` and returns the
    attention of each row over its slots ``pad[b] .. slot``, ``[M, Hq*D]``. ``splits > 1``: the
    slots split over that many programs a (row, KV head), merged by the last (``counters``: int32
    zeros, ``[M * KV heads]``, left zeros; a fresh set when ``None``). ``tune``: launch options
    for benchmarks (``BL``: slots a block, 64; ``num_warps``: 4; ``num_stages``: 2)."""
    m, hkv, d = k.shape[0], kc.shape[1], head_dim
    if head_dim % 2:
        raise ValueError(f"rope_attention: head_dim must be even, got {head_dim}")
    if kc.shape[0] != m or vc.shape[0] != m or pad.numel() < m:
        raise ValueError(f"rope_attention: {m} rows of q/k/v, but caches of {kc.shape[0]} / "
                         f"{vc.shape[0]} rows and {pad.numel()} pads")
    out = torch.empty((m, n_heads * d), dtype=k.dtype, device=kc.device)
    if splits > 1:
        pacc = torch.empty((m, n_heads, splits, d), dtype=torch.float32, device=kc.device)
        pm = torch.empty((m, n_heads, splits), dtype=torch.float32, device=kc.device)
        pl = torch.empty_like(pm)
        if counters is None:
            counters = torch.zeros(m * hkv, dtype=torch.int32, device=kc.device)
        elif counters.numel() < m * hkv or counters.dtype != torch.int32:
            raise ValueError(f"rope_attention: counters must be int32 zeros of at least rows x KV "
                             f"heads = {m * hkv} elements, got {counters.dtype} "
                             f"[{counters.numel()}]")
    else:
        pacc = pm = pl = counters = out  # not read
    g = n_heads // hkv
    raw = q.raw
    _attn_kernel[(m, hkv, splits)](
        raw, raw.stride(0), k, v, k.stride(0), v.stride(0), *_epi_args(q, k), kc, vc, kc.stride(0),
        kc.stride(1), kc.stride(2), inv_freq, slot, pad, rope_scale, scaling * 1.4426950408889634,
        out, out.stride(0), pacc, pm, pl, counters, HQ=n_heads, HKV=hkv, G=g, GP=max(16, np2(g)),
        D=d, DP=max(16, np2(d)), S=splits, **_flags(q), **launch_kw(pdl),
        **{"BL": BL, "num_warps": 4, "num_stages": 2, **(tune or {})})
    return out
