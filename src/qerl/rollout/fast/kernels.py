"""Triton kernels of the fast engine's decode step, and their launchers.

The base GEMMs produce raw outputs (no bias, no LoRA); the kernels that consume them apply the
group epilogue -- per-column scale (humming's NVFP4 global scales), bias, and the group's LoRA
output ``lo = (x a_cat^T) b_full^T`` (the fused LoRA kernel's or two cuBLAS GEMMs'; here it is
one more load per element) -- while doing their own work:

* :func:`add_rmsnorm`: ``h += epilogue(raw)`` then ``x = rmsnorm(h) * w`` (o and down outputs);
* the decode attention (epilogue of q/k/v, RoPE, K/V written into the static cache):
  :mod:`qerl.rollout.fast.attention`;
* :func:`silu_mul`: epilogue of gate/up, then ``silu(g) * u``.

The sampling kernel is in :mod:`qerl.rollout.fast.sampling`, beside its torch reference.

An :class:`Epilogue` names the raw output, the column offset of the member in its group and the
group's vectors. Everything runs in the model dtype with float32 arithmetic inside a kernel and
one rounding per value the torch path also rounds.

Every launcher takes ``pdl``: the kernel launched with programmatic dependent launch
(:mod:`qerl.rollout.fast.pdl`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl.rollout.fast.pdl import HAS_TRITON, launch_kw, tl, triton  # the one Triton import

__all__ = ["HAS_TRITON", "Epilogue", "add_rmsnorm", "silu_mul"]


def np2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


@dataclass
class Epilogue:
    """How to finish a raw GEMM output: ``raw * col_scale + bias + lora``.

    ``col_scale`` / ``bias`` / ``lora`` are the group's (indexed by global column ``offset + j``;
    ``lora [M, N_group]`` is the group's LoRA output in the model dtype)."""

    raw: torch.Tensor
    offset: int = 0
    col_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    lora: torch.Tensor | None = None


# Rows a program of the SiLU-mul kernel takes, at any row count: with 64 rows a program the 7B B=64
# RoPE kernel of the time ran 32 programs on 132 SMs; with 16, 453-576 -> 102-134 us a step
# (docs/benchmarks.md, run 16).
BLOCK_M = 16


if HAS_TRITON:
    from qerl.rollout.fast.pdl import pdl_enter

    @triton.jit
    def _epi_at(raw, m, cs, bias, cm, lo, HAS_CS: tl.constexpr, HAS_BIAS: tl.constexpr,
                HAS_LORA: tl.constexpr, DT: tl.constexpr):
        """A block of a finished GEMM output: ``raw`` and ``lo`` pointer blocks under mask ``m``,
        the column scale and bias pointer blocks (broadcastable to them) under ``cm``."""
        y = tl.load(raw, mask=m, other=0.0).to(tl.float32)
        if HAS_CS:
            y = y * tl.load(cs, mask=cm, other=0.0)
        if HAS_BIAS:
            y = y + tl.load(bias, mask=cm, other=0.0).to(tl.float32)
        if HAS_LORA:
            y = y + tl.load(lo, mask=m, other=0.0).to(tl.float32)
        return y.to(DT).to(tl.float32)

    @triton.jit
    def _epilogue(raw_ptr, sr, rows, rmask, lcol, gcol, cmask, cs_ptr, b_ptr, lo_ptr, slo,
                  HAS_CS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                  DT: tl.constexpr):
        r64 = rows[:, None].to(tl.int64)
        return _epi_at(raw_ptr + r64 * sr + lcol[None, :], rmask[:, None] & cmask[None, :],
                       cs_ptr + gcol[None, :], b_ptr + gcol[None, :], cmask[None, :],
                       lo_ptr + r64 * slo + gcol[None, :], HAS_CS, HAS_BIAS, HAS_LORA, DT)

    @triton.jit
    def _added(h_ptr, d_ptr, sd, off, cs_ptr, b_ptr, lo_ptr, slo, row, base, offs, cm, dt,
               HAS_ADD: tl.constexpr, HAS_CS: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_LORA: tl.constexpr):
        """Features ``offs`` of row ``row`` of ``h``, with the epilogue added (and stored back)."""
        h = tl.load(h_ptr + base + offs, mask=cm, other=0.0)
        if HAS_ADD:
            r64 = row.to(tl.int64)
            d = _epi_at(d_ptr + r64 * sd + offs, cm, cs_ptr + off + offs, b_ptr + off + offs, cm,
                        lo_ptr + r64 * slo + off + offs, HAS_CS, HAS_BIAS, HAS_LORA, dt)
            h = (h.to(tl.float32) + d).to(dt)
            tl.store(h_ptr + base + offs, h, mask=cm)
        return h

    @triton.jit
    def _add_rmsnorm_kernel(h_ptr, d_ptr, sd, off, cs_ptr, b_ptr, lo_ptr, slo, w_ptr, out_ptr, H,
                            eps, HAS_ADD: tl.constexpr, HAS_CS: tl.constexpr,
                            HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, CH: tl.constexpr,
                            ONE: tl.constexpr, PDL: tl.constexpr):
        """``ONE`` (``CH >= H``): the row in registers, one pass; else two passes of ``CH``
        features (the second reads back ``h``)."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        dt = h_ptr.dtype.element_ty
        base = row.to(tl.int64) * H
        if ONE:
            offs = tl.arange(0, CH)
            cm = offs < H
            hf = _added(h_ptr, d_ptr, sd, off, cs_ptr, b_ptr, lo_ptr, slo, row, base, offs, cm,
                        dt, HAS_ADD, HAS_CS, HAS_BIAS, HAS_LORA).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / H + eps)
            w = tl.load(w_ptr + offs, mask=cm, other=0.0).to(tl.float32)
            y = (hf * rstd).to(dt).to(tl.float32) * w
            tl.store(out_ptr + base + offs, y.to(out_ptr.dtype.element_ty), mask=cm)
        else:
            acc = tl.zeros((CH,), dtype=tl.float32)
            for c in range(0, H, CH):
                offs = c + tl.arange(0, CH)
                cm = offs < H
                hf = _added(h_ptr, d_ptr, sd, off, cs_ptr, b_ptr, lo_ptr, slo, row, base, offs,
                            cm, dt, HAS_ADD, HAS_CS, HAS_BIAS, HAS_LORA).to(tl.float32)
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
    def _silu_mul_kernel(g_ptr, u_ptr, sg, su, cs_ptr, b_ptr, lo_ptr, slo, act_ptr, M, NI,
                         HAS_CS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        rows = tl.program_id(0) * BM + tl.arange(0, BM)
        cols = tl.program_id(1) * BN + tl.arange(0, BN)
        rmask = rows < M
        cm = cols < NI
        dt = act_ptr.dtype.element_ty
        g = _epilogue(g_ptr, sg, rows, rmask, cols, cols, cm, cs_ptr, b_ptr, lo_ptr, slo,
                      HAS_CS, HAS_BIAS, HAS_LORA, dt)
        u = _epilogue(u_ptr, su, rows, rmask, cols, NI + cols, cm, cs_ptr, b_ptr, lo_ptr, slo,
                      HAS_CS, HAS_BIAS, HAS_LORA, dt)
        sg_ = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        act = (sg_ * u).to(dt)
        tl.store(act_ptr + rows[:, None].to(tl.int64) * NI + cols[None, :], act,
                 mask=rmask[:, None] & cm[None, :])

def _epi_args(e: Epilogue | None, like: torch.Tensor) -> tuple:
    """(col_scale, bias, lora, lora stride) pointers or dummies."""
    if e is None:
        return like, like, like, 0
    return (e.col_scale if e.col_scale is not None else like,
            e.bias if e.bias is not None else like,
            e.lora if e.lora is not None else like,
            e.lora.stride(0) if e.lora is not None else 0)


def _flags(e: Epilogue | None) -> dict:
    return {"HAS_CS": e is not None and e.col_scale is not None,
            "HAS_BIAS": e is not None and e.bias is not None,
            "HAS_LORA": e is not None and e.lora is not None}


# Widest row add_rmsnorm holds in registers in one pass (8,192 features: 32 a thread at 8 warps);
# wider rows, two passes of 1,024 (the kernel's loads are latency-bound at decode: one program a
# row, so every pass over the row is a round trip)
ONE_PASS_MAX = 8192


def add_rmsnorm(h: torch.Tensor, w: torch.Tensor, eps: float, add: Epilogue | None = None,
                pdl: bool = False, one_pass_max: int = ONE_PASS_MAX) -> torch.Tensor:
    """``h += epilogue(add)`` (in place, when given), then return ``rmsnorm(h) * w``."""
    m, hid = h.shape
    out = torch.empty_like(h)
    d = add.raw if add is not None else h
    one = hid <= one_pass_max
    _add_rmsnorm_kernel[(m,)](
        h, d, d.stride(0), add.offset if add is not None else 0, *_epi_args(add, h), w, out, hid,
        eps, HAS_ADD=add is not None, CH=np2(hid) if one else 1024, ONE=one,
        num_warps=8 if hid >= 2048 else 4, **_flags(add), **launch_kw(pdl))
    return out


def silu_mul(g: Epilogue, u: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` after the gate/up epilogue (``g`` describes the group, ``u`` is up's
    raw output)."""
    m, inter = u.shape
    act = torch.empty((m, inter), dtype=u.dtype, device=u.device)
    bm, bn = BLOCK_M, 128
    _silu_mul_kernel[(triton.cdiv(m, bm), triton.cdiv(inter, bn))](
        g.raw, u, g.raw.stride(0), u.stride(0), *_epi_args(g, u), act, m, inter, BM=bm, BN=bn,
        num_warps=4, **_flags(g), **launch_kw(pdl))
    return act
