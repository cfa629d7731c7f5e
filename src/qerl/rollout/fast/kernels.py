"""Triton kernels of the fast engine's decode step, and their launchers.

The base GEMMs produce raw outputs (no bias, no LoRA); the kernels that consume them apply the
group epilogue -- per-column scale (humming's stacked NVFP4), bias, and the LoRA expand
``xa @ b_full^T`` -- while doing their own work, so LoRA costs no extra launch there:

* :func:`lora_shrink`: ``xa = x @ a_cat^T`` for a whole group, split over K into float32 partial
  sums ``P [S, M, RP]`` that the consumer adds up (no atomics, deterministic);
* :func:`add_rmsnorm`: ``h += epilogue(raw)`` then ``x = rmsnorm(h) * w`` (o and down outputs);
* :func:`qkv_rope`: epilogue of q/k/v, RoPE, K/V written into the static cache;
* :func:`attention`: flash-decoding over the filled cache slots;
* :func:`silu_mul`: epilogue of gate/up, ``silu(g) * u``, and down's LoRA shrink of the result.

An :class:`Epilogue` names the raw output, the column offset of the member in its group and the
group's vectors. Everything runs in the model dtype with float32 arithmetic inside a kernel and
one rounding per value the torch path also rounds (bias / LoRA sums are rounded once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - pragma: no cover - depends on the machine
    triton = tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "Epilogue", "add_rmsnorm", "attention", "lora_shrink", "qkv_rope",
           "silu_mul"]


def np2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def rank_pad(r: int) -> int:
    """LoRA rank padded to what ``tl.dot`` takes (a power of two, at least 16)."""
    return max(16, np2(r))


@dataclass
class Epilogue:
    """How to finish a raw GEMM output: ``raw * col_scale + bias + xa @ lora_b^T``.

    ``col_scale`` / ``bias`` / ``lora_b`` are the group's (indexed by global column ``offset +
    j``); ``partials [S, M, RP]`` hold the group's LoRA shrink, ``rank`` its true rank."""

    raw: torch.Tensor
    offset: int = 0
    col_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    partials: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    rank: int = 0


def _block_m(m: int) -> int:
    return 16 if m <= 16 else (32 if m <= 32 else 64)


if HAS_TRITON:

    @triton.jit
    def _lora_xa(p_ptr, S, M, rows, rmask, RP: tl.constexpr, BM: tl.constexpr, DT: tl.constexpr):
        """Sum of the S partial shrinks of ``rows``: ``[BM, RP]`` in the model dtype."""
        offs_r = tl.arange(0, RP)
        xa = tl.zeros((BM, RP), dtype=tl.float32)
        for s in range(S):
            xa += tl.load(p_ptr + (s * M + rows[:, None]).to(tl.int64) * RP + offs_r[None, :],
                          mask=rmask[:, None], other=0.0)
        return xa.to(DT)

    @triton.jit
    def _epilogue(raw_ptr, sr, rows, rmask, lcol, gcol, cmask, cs_ptr, b_ptr, lb_ptr, slb, xa,
                  R, HAS_CS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                  RP: tl.constexpr, DT: tl.constexpr):
        m2 = rmask[:, None] & cmask[None, :]
        y = tl.load(raw_ptr + rows[:, None].to(tl.int64) * sr + lcol[None, :], mask=m2,
                    other=0.0).to(tl.float32)
        if HAS_CS:
            y = y * tl.load(cs_ptr + gcol, mask=cmask, other=0.0)[None, :]
        if HAS_BIAS:
            y = y + tl.load(b_ptr + gcol, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_LORA:
            offs_r = tl.arange(0, RP)
            bt = tl.load(lb_ptr + gcol[None, :].to(tl.int64) * slb + offs_r[:, None],
                         mask=(offs_r[:, None] < R) & cmask[None, :], other=0.0)
            y = y + tl.dot(xa, bt)
        return y.to(DT).to(tl.float32)

    @triton.jit
    def _lora_shrink_kernel(x_ptr, sx, a_ptr, sa, p_ptr, M, K, R, KS,
                            BM: tl.constexpr, RP: tl.constexpr, BK: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        s = tl.program_id(1)
        rmask = rows < M
        offs_r = tl.arange(0, RP)
        acc = tl.zeros((BM, RP), dtype=tl.float32)
        k_hi = tl.minimum(s * KS + KS, K)
        for k in range(s * KS, k_hi, BK):
            kk = k + tl.arange(0, BK)
            km = kk < k_hi
            xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * sx + kk[None, :],
                         mask=rmask[:, None] & km[None, :], other=0.0)
            at = tl.load(a_ptr + offs_r[:, None] * sa + kk[None, :],
                         mask=(offs_r[:, None] < R) & km[None, :], other=0.0)
            acc = tl.dot(xt, tl.trans(at), acc)
        tl.store(p_ptr + (s * M + rows[:, None]).to(tl.int64) * RP + offs_r[None, :], acc,
                 mask=rmask[:, None])

    @triton.jit
    def _add_rmsnorm_kernel(h_ptr, d_ptr, sd, off, cs_ptr, b_ptr, p_ptr, S, M, lb_ptr, slb, R,
                            w_ptr, out_ptr, H, eps, HAS_ADD: tl.constexpr, HAS_CS: tl.constexpr,
                            HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RP: tl.constexpr,
                            CH: tl.constexpr):
        row = tl.program_id(0)
        dt = h_ptr.dtype.element_ty
        base = row.to(tl.int64) * H
        offs_r = tl.arange(0, RP)
        xa = tl.zeros((RP,), dtype=tl.float32)
        if HAS_LORA:
            for s in range(S):
                xa += tl.load(p_ptr + (s * M + row).to(tl.int64) * RP + offs_r)
            xa = xa.to(dt).to(tl.float32)
        acc = tl.zeros((CH,), dtype=tl.float32)
        for c in range(0, H, CH):
            offs = c + tl.arange(0, CH)
            cm = offs < H
            h = tl.load(h_ptr + base + offs, mask=cm, other=0.0)
            if HAS_ADD:
                d = tl.load(d_ptr + row.to(tl.int64) * sd + offs, mask=cm, other=0.0)
                d = d.to(tl.float32)
                if HAS_CS:
                    d = d * tl.load(cs_ptr + off + offs, mask=cm, other=0.0)
                if HAS_BIAS:
                    d = d + tl.load(b_ptr + off + offs, mask=cm, other=0.0).to(tl.float32)
                if HAS_LORA:
                    bt = tl.load(lb_ptr + (off + offs[:, None]).to(tl.int64) * slb
                                 + offs_r[None, :], mask=cm[:, None] & (offs_r[None, :] < R),
                                 other=0.0)
                    d = d + tl.sum(bt.to(tl.float32) * xa[None, :], axis=1)
                h = (h.to(tl.float32) + d.to(dt).to(tl.float32)).to(dt)
                tl.store(h_ptr + base + offs, h, mask=cm)
            hf = h.to(tl.float32)
            acc += hf * hf
        tl.debug_barrier()
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / H + eps)
        for c in range(0, H, CH):
            offs = c + tl.arange(0, CH)
            cm = offs < H
            hf = tl.load(h_ptr + base + offs, mask=cm, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=cm, other=0.0).to(tl.float32)
            y = (hf * rstd).to(dt).to(tl.float32) * w
            tl.store(out_ptr + base + offs, y.to(out_ptr.dtype.element_ty), mask=cm)

    @triton.jit
    def _qkv_rope_kernel(q_ptr, k_ptr, v_ptr, sq, sk, sv, cs_ptr, b_ptr, p_ptr, S, lb_ptr, slb,
                         R, qo_ptr, kc_ptr, vc_ptr, skb, skh, skl, invf_ptr, slot_ptr, pad_ptr,
                         rope_scale, M, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                         HALF: tl.constexpr, HALFP: tl.constexpr, HAS_CS: tl.constexpr,
                         HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, RP: tl.constexpr,
                         BM: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        h = tl.program_id(1)
        rmask = rows < M
        dt = qo_ptr.dtype.element_ty
        i = tl.arange(0, HALFP)
        im = i < HALF
        slot = tl.load(slot_ptr)
        pos = (slot - tl.load(pad_ptr + rows, mask=rmask, other=0)).to(tl.float32)
        f = pos[:, None] * tl.load(invf_ptr + i, mask=im, other=0.0).to(tl.float32)[None, :]
        c = tl.cos(f) * rope_scale
        s = tl.sin(f) * rope_scale
        xa = tl.zeros((BM, RP), dtype=dt)
        if HAS_LORA:
            xa = _lora_xa(p_ptr, S, M, rows, rmask, RP, BM, dt)
        m2 = rmask[:, None] & im[None, :]
        r64 = rows[:, None].to(tl.int64)
        if h < HQ:
            col = h * D + i
            x1 = _epilogue(q_ptr, sq, rows, rmask, col, col, im, cs_ptr, b_ptr, lb_ptr, slb, xa,
                           R, HAS_CS, HAS_BIAS, HAS_LORA, RP, dt)
            x2 = _epilogue(q_ptr, sq, rows, rmask, col + HALF, col + HALF, im, cs_ptr, b_ptr,
                           lb_ptr, slb, xa, R, HAS_CS, HAS_BIAS, HAS_LORA, RP, dt)
            dst = qo_ptr + (r64 * HQ + h) * D + i[None, :]
            tl.store(dst, (x1 * c - x2 * s).to(dt), mask=m2)
            tl.store(dst + HALF, (x2 * c + x1 * s).to(dt), mask=m2)
        else:
            kh = h - HQ
            col = kh * D + i
            gk = HQ * D + col
            k1 = _epilogue(k_ptr, sk, rows, rmask, col, gk, im, cs_ptr, b_ptr, lb_ptr, slb, xa,
                           R, HAS_CS, HAS_BIAS, HAS_LORA, RP, dt)
            k2 = _epilogue(k_ptr, sk, rows, rmask, col + HALF, gk + HALF, im, cs_ptr, b_ptr,
                           lb_ptr, slb, xa, R, HAS_CS, HAS_BIAS, HAS_LORA, RP, dt)
            gv = gk + HKV * D
            v1 = _epilogue(v_ptr, sv, rows, rmask, col, gv, im, cs_ptr, b_ptr, lb_ptr, slb, xa,
                           R, HAS_CS, HAS_BIAS, HAS_LORA, RP, dt)
            v2 = _epilogue(v_ptr, sv, rows, rmask, col + HALF, gv + HALF, im, cs_ptr, b_ptr,
                           lb_ptr, slb, xa, R, HAS_CS, HAS_BIAS, HAS_LORA, RP, dt)
            koff = r64 * skb + kh * skh + slot.to(tl.int64) * skl + i[None, :]
            tl.store(kc_ptr + koff, (k1 * c - k2 * s).to(dt), mask=m2)
            tl.store(kc_ptr + koff + HALF, (k2 * c + k1 * s).to(dt), mask=m2)
            tl.store(vc_ptr + koff, v1.to(dt), mask=m2)
            tl.store(vc_ptr + koff + HALF, v2.to(dt), mask=m2)

    @triton.jit
    def _attn_decode_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, slot_ptr, pad_ptr, qk_scale,
                            skb, skh, skl, so, HQ: tl.constexpr, G: tl.constexpr,
                            GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                            BL: tl.constexpr):
        b = tl.program_id(0)
        kh = tl.program_id(1)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, DP)
        offs_l = tl.arange(0, BL)
        dmask = offs_d < D
        qmask = (offs_g[:, None] < G) & dmask[None, :]
        qrow = b.to(tl.int64) * HQ + kh * G + offs_g
        q = tl.load(q_ptr + qrow[:, None] * D + offs_d[None, :], mask=qmask, other=0.0)
        slot = tl.load(slot_ptr)
        padb = tl.load(pad_ptr + b)
        m_i = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GP,), dtype=tl.float32)
        acc = tl.zeros((GP, DP), dtype=tl.float32)
        kbase = kc_ptr + b.to(tl.int64) * skb + kh * skh
        vbase = vc_ptr + b.to(tl.int64) * skb + kh * skh
        for start in range((padb // BL) * BL, slot + 1, BL):
            ll = start + offs_l
            lmask = ll <= slot
            kv_mask = lmask[:, None] & dmask[None, :]
            k = tl.load(kbase + ll[:, None] * skl + offs_d[None, :], mask=kv_mask, other=0.0)
            sc = tl.dot(q, tl.trans(k)) * qk_scale
            sc = tl.where(((ll >= padb) & lmask)[None, :], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            p = tl.exp2(sc - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vbase + ll[:, None] * skl + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        col = (kh * G + offs_g)[:, None] * D + offs_d[None, :]
        tl.store(o_ptr + b.to(tl.int64) * so + col, (acc / l_i[:, None]).to(o_ptr.dtype.element_ty),
                 mask=qmask)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, sg, su, cs_ptr, b_ptr, p_ptr, S, lb_ptr, slb, R,
                         act_ptr, ad_ptr, sad, pd_ptr, RD, M, NI,
                         HAS_CS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                         RP: tl.constexpr, HAS_DOWN: tl.constexpr, RPD: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr):
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        nb = tl.program_id(1)
        cols = nb * BN + tl.arange(0, BN)
        rmask = rows < M
        cm = cols < NI
        dt = act_ptr.dtype.element_ty
        xa = tl.zeros((BM, RP), dtype=dt)
        if HAS_LORA:
            xa = _lora_xa(p_ptr, S, M, rows, rmask, RP, BM, dt)
        g = _epilogue(g_ptr, sg, rows, rmask, cols, cols, cm, cs_ptr, b_ptr, lb_ptr, slb, xa,
                      R, HAS_CS, HAS_BIAS, HAS_LORA, RP, dt)
        u = _epilogue(u_ptr, su, rows, rmask, cols, NI + cols, cm, cs_ptr, b_ptr, lb_ptr, slb,
                      xa, R, HAS_CS, HAS_BIAS, HAS_LORA, RP, dt)
        sg_ = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        act = (sg_ * u).to(dt)
        tl.store(act_ptr + rows[:, None].to(tl.int64) * NI + cols[None, :], act,
                 mask=rmask[:, None] & cm[None, :])
        if HAS_DOWN:
            offs_r = tl.arange(0, RPD)
            at = tl.load(ad_ptr + offs_r[:, None] * sad + cols[None, :],
                         mask=(offs_r[:, None] < RD) & cm[None, :], other=0.0)
            part = tl.dot(act, tl.trans(at))
            tl.store(pd_ptr + (nb * M + rows[:, None]).to(tl.int64) * RPD + offs_r[None, :],
                     part, mask=rmask[:, None])


def shrink_splits(k: int) -> int:
    """How many K slices :func:`lora_shrink` uses (128 columns each, at most 64)."""
    return max(1, min(64, -(-k // 128)))


def lora_shrink(x: torch.Tensor, a_cat: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Partial sums of ``x [M, K] @ a_cat [R, K]^T`` into ``out [S, M, RP]`` (float32)."""
    m, k = x.shape
    s = out.shape[0]
    ks = -(-k // s)
    bm = _block_m(m)
    _lora_shrink_kernel[(triton.cdiv(m, bm), s)](
        x, x.stride(0), a_cat, a_cat.stride(0), out, m, k, a_cat.shape[0], ks,
        BM=bm, RP=out.shape[2], BK=64, num_warps=4)
    return out


def _epi_args(e: Epilogue | None, like: torch.Tensor) -> tuple:
    """(col_scale, bias, partials, S, lora_b, lora_b stride, rank) pointers or dummies."""
    if e is None:
        return like, like, like, 0, like, 0, 0
    p = e.partials
    return (e.col_scale if e.col_scale is not None else like,
            e.bias if e.bias is not None else like,
            p if p is not None else like, p.shape[0] if p is not None else 0,
            e.lora_b if e.lora_b is not None else like,
            e.lora_b.stride(0) if e.lora_b is not None else 0, e.rank)


def _flags(e: Epilogue | None) -> dict:
    return {"HAS_CS": e is not None and e.col_scale is not None,
            "HAS_BIAS": e is not None and e.bias is not None,
            "HAS_LORA": e is not None and e.partials is not None,
            "RP": e.partials.shape[2] if e is not None and e.partials is not None else 16}


def add_rmsnorm(h: torch.Tensor, w: torch.Tensor, eps: float,
                add: Epilogue | None = None) -> torch.Tensor:
    """``h += epilogue(add)`` (in place, when given), then return ``rmsnorm(h) * w``."""
    m, hid = h.shape
    out = torch.empty_like(h)
    cs, b, p, s, lb, slb, r = _epi_args(add, h)
    flags = _flags(add)
    d = add.raw if add is not None else h
    _add_rmsnorm_kernel[(m,)](
        h, d, d.stride(0), add.offset if add is not None else 0, cs, b, p, s, m, lb, slb, r,
        w, out, hid, eps, HAS_ADD=add is not None, CH=256 if flags["HAS_LORA"] else 1024,
        num_warps=8 if hid >= 2048 else 4, **flags)
    return out


def qkv_rope(q: Epilogue, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
             inv_freq: torch.Tensor, slot: torch.Tensor, pad: torch.Tensor, rope_scale: float,
             n_heads: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """Finish q/k/v (epilogue ``q`` describes the group; ``k``/``v`` are the other members'
    raw outputs), rotate q and k, write k/v at cache slot ``slot``; returns q ``[M, Hq, D]``."""
    m = k.shape[0]
    qo = torch.empty((m, n_heads, head_dim), dtype=k.dtype, device=k.device)
    cs, b, p, s, lb, slb, r = _epi_args(q, k)
    bm = _block_m(m)
    half = head_dim // 2
    raw = q.raw
    _qkv_rope_kernel[(triton.cdiv(m, bm), n_heads + n_kv)](
        raw, k, v, raw.stride(0), k.stride(0), v.stride(0), cs, b, p, s, lb, slb, r, qo, kc, vc,
        kc.stride(0), kc.stride(1), kc.stride(2), inv_freq, slot, pad, rope_scale, m,
        HQ=n_heads, HKV=n_kv, D=head_dim, HALF=half, HALFP=max(16, np2(half)), BM=bm,
        num_warps=4, **_flags(q))
    return qo


def attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slot: torch.Tensor,
              pad: torch.Tensor, scaling: float) -> torch.Tensor:
    """Decode attention of ``q [M, Hq, D]`` over cache slots ``pad[b] .. slot``: ``[M, Hq*D]``."""
    m, hq, d = q.shape
    hkv = kc.shape[1]
    g = hq // hkv
    out = torch.empty((m, hq * d), dtype=q.dtype, device=q.device)
    _attn_decode_kernel[(m, hkv)](
        q, kc, vc, out, slot, pad, scaling * 1.4426950408889634, kc.stride(0), kc.stride(1),
        kc.stride(2), out.stride(0), HQ=hq, G=g, GP=max(16, np2(g)), D=d, DP=max(16, np2(d)),
        BL=64, num_warps=4)
    return out


def silu_mul(g: Epilogue, u: torch.Tensor, down_a: torch.Tensor | None = None,
             down_partials: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` after the gate/up epilogue (``g`` describes the group, ``u`` is up's
    raw output); with ``down_a [Rd, I]``, also down's LoRA shrink into ``down_partials``."""
    m, inter = u.shape
    act = torch.empty((m, inter), dtype=u.dtype, device=u.device)
    cs, b, p, s, lb, slb, r = _epi_args(g, u)
    bm, bn = _block_m(m), 128
    has_down = down_a is not None
    _silu_mul_kernel[(triton.cdiv(m, bm), triton.cdiv(inter, bn))](
        g.raw, u, g.raw.stride(0), u.stride(0), cs, b, p, s, lb, slb, r, act,
        down_a if has_down else u, down_a.stride(0) if has_down else 0,
        down_partials if has_down else u, down_a.shape[0] if has_down else 0, m, inter,
        HAS_DOWN=has_down, RPD=down_partials.shape[2] if has_down else 16, BM=bm, BN=bn,
        num_warps=4, **_flags(g))
    return act


def down_splits(inter: int) -> int:
    """Partial count of down's LoRA shrink done by :func:`silu_mul` (one per 128 columns)."""
    return -(-inter // 128)
