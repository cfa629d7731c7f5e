"""The fast rollout engine: static KV cache, CUDA-graph decode, 4-bit weights read once per step.

One engine, two backends over the same plan of the model:

* ``triton`` (CUDA, bf16 models): prefill in eager torch (cuBLAS GEMMs; FP4 weights dequantized
  layer by layer into a scratch buffer for large token counts, the fused FP4 kernel for small
  ones), then every decode step is one CUDA graph replay: Triton RMSNorm (fused with the residual
  add), the fused FP4 matmul (NVFP4 / MXFP4 codes decoded inside the matmul, LoRA ``B`` and the bias
  in its epilogue, gate/up fused with SiLU-mul), a RoPE + KV-cache-write kernel, a flash-decoding
  attention kernel over the static cache (it reads only the filled slots), cuBLAS for dense
  weights and the LM head, and sampling on the GPU.
* ``torch`` (any device, no graphs, no Triton): the same computation in plain torch (FP4 weights
  dequantized with the torch reference once per ``generate`` call). The CPU tests run it against
  transformers ``generate``.

What it reads from the model -- always the live tensors, never copies made at build time:

* the decoder (Qwen2 / Llama style: RMSNorm, RoPE from the model's rotary module, GQA, SiLU MLP,
  optional q/k/v bias, tied or untied LM head), unwrapped from a peft ``PeftModel`` if needed;
* base linears: ``QuantLinear`` (``fmt``, ``weight_packed``, ``weight_scale``,
  ``weight_global_scale``), ``nn.Linear``, or any other module (called as is, e.g. bitsandbytes);
* peft LoRA layers: the active, non-disabled, unmerged adapters are applied unmerged,
  ``y = base(x) + (x A^T) (scaling B)^T``. The adapter weights are copied into bf16 shadows at the
  start of every ``generate`` call (adapters do not change during a rollout);
* the RMSNorm weights by reference, so AQN noise applied in place before a rollout is seen by the
  captured graph. If a tensor is *replaced* (new storage), the plan and graphs are rebuilt.

Log-prob convention (see :mod:`qerl.rollout.base`): ``log_softmax(logits / T)[token]``, top-p not
renormalised; greedy uses ``T = 1``. Sampling draws one uniform per row and step from the caller's
generator (inverse-CDF over the sorted nucleus), so a run is reproducible given the generator.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from qerl.kernels import fp4_matmul as fk
from qerl.rollout.base import RolloutBatch, SamplingParams

HAS_TRITON = fk.HAS_TRITON
if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = ["FastEngine", "FastRolloutEngine", "build_plan"]


# ----------------------------------------------------------------------------------------------
# the model plan
# ----------------------------------------------------------------------------------------------


@dataclass
class _Member:
    """One projection: its base weight (live tensors) and its LoRA adapters."""

    name: str
    kind: str  # "fp4" | "dense" | "module"
    in_f: int
    out_f: int
    module: nn.Module
    bias: torch.Tensor | None = None
    weight: torch.Tensor | None = None  # dense
    fmt: str | None = None  # fp4
    packed: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    gscale: torch.Tensor | None = None
    lora: list = field(default_factory=list)  # [(A param [r,in], B param [out,r], scaling)]
    lora_off: int = 0
    lora_r: int = 0
    b_shadow: torch.Tensor | None = None  # [out, r_total] compute dtype, scaling folded in
    deq_cache: torch.Tensor | None = None  # torch backend: dequantized weight for one generate()

    def tensors(self) -> list[torch.Tensor]:
        ts = [t for t in (self.bias, self.weight, self.packed, self.scale, self.gscale) if t is not None]
        for a, b, _ in self.lora:
            ts += [a, b]
        return ts


@dataclass
class _Group:
    """Projections that share one input (q/k/v, o, gate/up, down, lm_head)."""

    members: list[_Member]
    perm: bool = False  # decode input arrives in the FP4 kernels' permuted layout
    r_total: int = 0
    a_nat: torch.Tensor | None = None  # [r_total, K] natural column order
    a_perm: torch.Tensor | None = None  # [r_total, K] permuted column order

    @property
    def in_f(self) -> int:
        return self.members[0].in_f

    @property
    def all_fp4(self) -> bool:
        return all(m.kind == "fp4" for m in self.members)


@dataclass
class _Layer:
    ln1: torch.Tensor
    eps1: float
    ln2: torch.Tensor
    eps2: float
    qkv: _Group
    o: _Group
    gu: _Group
    down: _Group
    scaling: float


@dataclass
class _Plan:
    model_id: int
    dtype: torch.dtype
    device: torch.device
    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    vocab: int
    embed: torch.Tensor
    layers: list[_Layer]
    norm: torch.Tensor
    norm_eps: float
    lm_head: _Group
    inv_freq: torch.Tensor
    rope_scale: float
    signature: tuple
    adapters: tuple

    def groups(self):
        for L in self.layers:
            yield from (L.qkv, L.o, L.gu, L.down)
        yield self.lm_head


def _unwrap(model: nn.Module):
    base = model
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    dec = getattr(base, "model", None)
    if dec is None or not hasattr(dec, "layers") or not hasattr(dec, "embed_tokens"):
        raise NotImplementedError(
            f"fast engine: {type(base).__name__} is not a Llama/Qwen2-style causal LM "
            "(expected .model.layers and .model.embed_tokens)"
        )
    lm_head = getattr(base, "lm_head", None) or base.get_output_embeddings()
    return base, dec, lm_head


def _is_fp4(mod: nn.Module) -> bool:
    return getattr(mod, "fmt", None) in fk.FP4_FORMATS and hasattr(mod, "weight_packed") \
        and hasattr(mod, "weight_scale")


def _member(name: str, mod: nn.Module) -> tuple[_Member, tuple]:
    lora: list = []
    adapters: tuple = ()
    base = mod
    if hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
        base = mod.base_layer
        if not getattr(mod, "disable_adapters", False) and not getattr(mod, "merged", False):
            active = mod.active_adapters
            if isinstance(active, str):
                active = [active]
            for a in active:
                if a not in mod.lora_A:
                    continue
                if getattr(mod, "use_dora", {}).get(a, False):
                    raise NotImplementedError("fast engine: DoRA adapters are not supported")
                lora.append((mod.lora_A[a].weight, mod.lora_B[a].weight, float(mod.scaling[a])))
                adapters += ((a, float(mod.scaling[a])),)
    if _is_fp4(base):
        m = _Member(name, "fp4", base.in_features, base.out_features, base,
                    bias=getattr(base, "bias", None), fmt=base.fmt, packed=base.weight_packed,
                    scale=base.weight_scale, gscale=getattr(base, "weight_global_scale", None))
        if m.fmt == "nvfp4" and m.gscale is None:
            raise ValueError(f"{name}: NVFP4 layer without weight_global_scale")
    elif isinstance(base, nn.Linear) and isinstance(getattr(base, "weight", None), torch.Tensor) \
            and base.weight.is_floating_point() and type(base).__name__ != "Linear4bit":
        m = _Member(name, "dense", base.in_features, base.out_features, base, bias=base.bias,
                    weight=base.weight)
    else:
        in_f = getattr(base, "in_features", None)
        out_f = getattr(base, "out_features", None)
        if in_f is None or out_f is None:
            raise NotImplementedError(f"fast engine: unsupported layer {name}: {type(base).__name__}")
        m = _Member(name, "module", in_f, out_f, base, bias=None)
    m.lora = lora
    return m, adapters


def _group(names_mods: list[tuple[str, nn.Module]], permuted_x: bool) -> tuple[_Group, tuple]:
    members, adapters = [], ()
    for n, mod in names_mods:
        m, a = _member(n, mod)
        members.append(m)
        adapters += ((n, a),)
    g = _Group(members)
    off = 0
    for m in members:
        m.lora_off = off
        m.lora_r = sum(a.shape[0] for a, _, _ in m.lora)
        off += m.lora_r
    g.r_total = off
    g.perm = bool(permuted_x and g.all_fp4 and g.in_f % 8 == 0)
    return g, adapters


def build_plan(model: nn.Module, permuted_x: bool = True) -> _Plan:
    """Walk ``model`` and collect live references to everything the engine reads."""
    base, dec, lm_head = _unwrap(model)
    cfg = base.config
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise NotImplementedError("fast engine: sliding-window attention is not supported")
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise NotImplementedError(f"fast engine: activation {act!r} is not supported")
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    rot = getattr(dec, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        raise NotImplementedError("fast engine: the model has no rotary_emb.inv_freq")
    rope_type = getattr(rot, "rope_type", "default")
    if rope_type == "dynamic":
        raise NotImplementedError("fast engine: dynamic RoPE scaling is not supported")
    layers, adapters = [], ()
    for i, layer in enumerate(dec.layers):
        at, mlp = layer.self_attn, layer.mlp
        if hasattr(at, "q_norm") or hasattr(at, "k_norm"):
            raise NotImplementedError("fast engine: q/k norms (Qwen3) are not supported")
        p = f"layers.{i}."
        qkv, a1 = _group([(p + "q_proj", at.q_proj), (p + "k_proj", at.k_proj),
                          (p + "v_proj", at.v_proj)], permuted_x)
        o, a2 = _group([(p + "o_proj", at.o_proj)], permuted_x)
        gu, a3 = _group([(p + "gate_proj", mlp.gate_proj), (p + "up_proj", mlp.up_proj)], permuted_x)
        down, a4 = _group([(p + "down_proj", mlp.down_proj)], permuted_x)
        adapters += a1 + a2 + a3 + a4
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(_Layer(
            ln1=ln1.weight, eps1=float(getattr(ln1, "variance_epsilon", getattr(ln1, "eps", 1e-6))),
            ln2=ln2.weight, eps2=float(getattr(ln2, "variance_epsilon", getattr(ln2, "eps", 1e-6))),
            qkv=qkv, o=o, gu=gu, down=down,
            scaling=float(getattr(at, "scaling", head_dim ** -0.5)),
        ))
    head, a5 = _group([("lm_head", lm_head)], False)
    adapters += a5
    embed = dec.embed_tokens.weight
    plan = _Plan(
        model_id=id(model), dtype=embed.dtype, device=embed.device, hidden=cfg.hidden_size,
        n_heads=n_heads, n_kv=n_kv, head_dim=head_dim, vocab=embed.shape[0], embed=embed,
        layers=layers, norm=dec.norm.weight,
        norm_eps=float(getattr(dec.norm, "variance_epsilon", getattr(dec.norm, "eps", 1e-6))),
        lm_head=head, inv_freq=rot.inv_freq, rope_scale=float(getattr(rot, "attention_scaling", 1.0)),
        signature=(), adapters=adapters,
    )
    plan.signature = _signature(plan)
    return plan


def _plan_tensors(plan: _Plan) -> list[torch.Tensor]:
    ts = [plan.embed, plan.norm, plan.inv_freq]
    for L in plan.layers:
        ts += [L.ln1, L.ln2]
    for g in plan.groups():
        for m in g.members:
            ts += m.tensors()
    return ts


def _signature(plan: _Plan) -> tuple:
    return tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in _plan_tensors(plan))


def _refresh_lora(plan: _Plan) -> None:
    """Copy the live adapter weights into the compute-dtype shadows (scaling folded into B)."""
    dt = plan.dtype
    for g in plan.groups():
        if g.r_total == 0:
            continue
        a_rows = []
        for m in g.members:
            if not m.lora:
                continue
            a_rows += [a.detach().to(plan.device, torch.float32) for a, _, _ in m.lora]
            b = torch.cat([b.detach().to(plan.device, torch.float32) * s for _, b, s in m.lora], dim=1)
            if m.b_shadow is None or m.b_shadow.shape != b.shape:
                m.b_shadow = torch.empty(b.shape, dtype=dt, device=plan.device)
            m.b_shadow.copy_(b)
        a = torch.cat(a_rows, dim=0)
        if g.a_nat is None or g.a_nat.shape != a.shape:
            g.a_nat = torch.empty(a.shape, dtype=dt, device=plan.device)
            g.a_perm = torch.empty(a.shape, dtype=dt, device=plan.device) if g.perm else None
        g.a_nat.copy_(a)
        if g.perm:
            g.a_perm.copy_(fk.permute_activation(a))


# ----------------------------------------------------------------------------------------------
# sampling (torch ops only: runs eagerly on CPU and inside the CUDA graph on GPU)
# ----------------------------------------------------------------------------------------------


def sample_tokens(logits: torch.Tensor, u: torch.Tensor, temperature: torch.Tensor,
                  top_p: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token per row: ``(token, logprob, entropy)``.

    ``mode``: ``greedy`` (argmax, T=1 log-probs), ``full`` (temperature only) or ``top_p``.
    ``u`` [B] uniforms in [0, 1): the token is the first one whose cumulative (sorted, for top-p)
    probability exceeds ``u`` times the kept mass.
    """
    x = logits.float()
    V = x.shape[-1]
    if mode == "greedy":
        logp = torch.log_softmax(x, dim=-1)
        tok = x.argmax(dim=-1)
    else:
        logp = torch.log_softmax(x / temperature, dim=-1)
        if mode == "full":
            c = logp.exp().cumsum(dim=-1)
            target = (u * c[:, -1]).unsqueeze(-1)
            tok = torch.searchsorted(c, target, right=True).clamp_max(V - 1).squeeze(-1)
        else:
            _, sidx = torch.sort(logits, dim=-1, descending=True)
            sp = logp.gather(-1, sidx).exp()
            c = sp.cumsum(dim=-1)
            keep = (c - sp) < top_p
            nkeep = keep.sum(dim=-1, keepdim=True).clamp_min(1)
            z = c.gather(-1, nkeep - 1)
            j = torch.searchsorted(c, u.unsqueeze(-1) * z, right=True)
            j = torch.minimum(j, nkeep - 1)
            tok = sidx.gather(-1, j).squeeze(-1)
    lp = logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(dim=-1)
    return tok, lp, ent


# ----------------------------------------------------------------------------------------------
# Triton helper kernels (RMSNorm, RoPE + cache write, decode attention)
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _add_rmsnorm_kernel(h_ptr, d_ptr, w_ptr, out_ptr, H, eps,
                            HAS_ADD: tl.constexpr, PERM: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        base = row.to(tl.int64) * H
        h = tl.load(h_ptr + base + offs, mask=mask, other=0.0)
        if HAS_ADD:
            d = tl.load(d_ptr + base + offs, mask=mask, other=0.0)
            h = (h.to(tl.float32) + d.to(tl.float32)).to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + base + offs, h, mask=mask)
        hf = h.to(tl.float32)
        var = tl.sum(hf * hf, axis=0) / H
        y = (hf * tl.rsqrt(var + eps)).to(h_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = y * w
        if PERM:
            col = (offs % 8) * (H // 8) + offs // 8
        else:
            col = offs
        tl.store(out_ptr + base + col, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, invf_ptr, slot_ptr,
                           pad_ptr, sq, sk, sv, skb, skh, skl, rope_scale,
                           HQ: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                           HALFP: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        i = tl.arange(0, HALFP)
        im = i < HALF
        slot = tl.load(slot_ptr)
        pos = (slot - tl.load(pad_ptr + b)).to(tl.float32)
        f = pos * tl.load(invf_ptr + i, mask=im, other=0.0).to(tl.float32)
        c = tl.cos(f) * rope_scale
        s = tl.sin(f) * rope_scale
        if h < HQ:
            qsrc = q_ptr + b.to(tl.int64) * sq + h * D
            x1 = tl.load(qsrc + i, mask=im, other=0.0).to(tl.float32)
            x2 = tl.load(qsrc + HALF + i, mask=im, other=0.0).to(tl.float32)
            qdst = qo_ptr + (b.to(tl.int64) * HQ + h) * D
            tl.store(qdst + i, (x1 * c - x2 * s).to(qo_ptr.dtype.element_ty), mask=im)
            tl.store(qdst + HALF + i, (x2 * c + x1 * s).to(qo_ptr.dtype.element_ty), mask=im)
        else:
            kh = h - HQ
            ksrc = k_ptr + b.to(tl.int64) * sk + kh * D
            k1 = tl.load(ksrc + i, mask=im, other=0.0).to(tl.float32)
            k2 = tl.load(ksrc + HALF + i, mask=im, other=0.0).to(tl.float32)
            koff = b.to(tl.int64) * skb + kh * skh + slot.to(tl.int64) * skl
            tl.store(kc_ptr + koff + i, (k1 * c - k2 * s).to(kc_ptr.dtype.element_ty), mask=im)
            tl.store(kc_ptr + koff + HALF + i, (k2 * c + k1 * s).to(kc_ptr.dtype.element_ty),
                     mask=im)
            vsrc = v_ptr + b.to(tl.int64) * sv + kh * D
            v1 = tl.load(vsrc + i, mask=im, other=0.0)
            v2 = tl.load(vsrc + HALF + i, mask=im, other=0.0)
            tl.store(vc_ptr + koff + i, v1, mask=im)
            tl.store(vc_ptr + koff + HALF + i, v2, mask=im)

    @triton.jit
    def _attn_decode_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, slot_ptr, pad_ptr, qk_scale,
                            skb, skh, skl, so,
                            HQ: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                            DP: tl.constexpr, BL: tl.constexpr, PERM: tl.constexpr):
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
        lo = (padb // BL) * BL
        m_i = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GP,), dtype=tl.float32)
        acc = tl.zeros((GP, DP), dtype=tl.float32)
        kbase = kc_ptr + b.to(tl.int64) * skb + kh * skh
        vbase = vc_ptr + b.to(tl.int64) * skb + kh * skh
        for start in range(lo, slot + 1, BL):
            ll = start + offs_l
            lmask = ll <= slot
            kv_mask = lmask[:, None] & dmask[None, :]
            k = tl.load(kbase + ll[:, None] * skl + offs_d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            valid = (ll >= padb) & lmask
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(vbase + ll[:, None] * skl + offs_d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        out = acc / l_i[:, None]
        col = (kh * G + offs_g)[:, None] * D + offs_d[None, :]
        if PERM:
            col = (col % 8) * (HQ * D // 8) + col // 8
        tl.store(o_ptr + b.to(tl.int64) * so + col, out.to(o_ptr.dtype.element_ty), mask=qmask)


def _np2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _add_rmsnorm(h, d, w, eps, perm: bool):
    """``h += d`` (if ``d`` given, rounded to h's dtype) then ``rmsnorm(h) * w`` (optionally permuted)."""
    M, H = h.shape
    out = torch.empty_like(h)
    _add_rmsnorm_kernel[(M,)](h, d if d is not None else h, w, out, H, eps,
                              HAS_ADD=d is not None, PERM=perm, BLOCK=_np2(H),
                              num_warps=4 if H <= 4096 else 8)
    return out


# ----------------------------------------------------------------------------------------------
# decode state (static buffers a CUDA graph can be captured over)
# ----------------------------------------------------------------------------------------------


@dataclass
class _State:
    key: tuple
    n_rows: int
    cap: int  # KV slots
    t_cap: int  # max new tokens
    mode: str
    k: list
    v: list
    tok: torch.Tensor
    slot: torch.Tensor
    step: torch.Tensor
    pad: torch.Tensor
    done: torch.Tensor
    u: torch.Tensor
    temp: torch.Tensor
    top_p: torch.Tensor
    eos: torch.Tensor
    pad_id: torch.Tensor
    out_tok: torch.Tensor
    out_lp: torch.Tensor
    out_mask: torch.Tensor
    out_ent: torch.Tensor
    graph: object = None
    graph_sig: tuple = ()


# ----------------------------------------------------------------------------------------------
# the engine
# ----------------------------------------------------------------------------------------------


class FastEngine:
    """Static-cache rollout engine (see the module docstring).

    Args:
        backend: ``auto`` (``triton`` on CUDA for bf16 models when Triton is installed, else
            ``torch``), ``triton`` or ``torch``.
        use_cuda_graph: capture the decode step as a CUDA graph (CUDA only).
        check_every: decode steps between checks of "all rows done" (early exit; one host sync).
        prefill_dequant_min_tokens: prefill token counts from which FP4 weights are dequantized
            to a bf16 scratch and multiplied with cuBLAS (below it: the fused FP4 kernel).
        permuted_x: let producer kernels write FP4 inputs in the kernels' permuted layout.
        cache_multiple: the KV capacity is rounded up to this multiple so graphs are reused across
            calls whose prompt lengths differ a little.
    """

    name = "fast"

    def __init__(self, backend: str = "auto", use_cuda_graph: bool = True, check_every: int = 16,
                 prefill_dequant_min_tokens: int = 1024, permuted_x: bool | None = None,
                 cache_multiple: int = 128) -> None:
        if backend not in ("auto", "triton", "torch"):
            raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
        self.backend = backend
        self.use_cuda_graph = use_cuda_graph
        self.check_every = max(1, int(check_every))
        self.prefill_dequant_min_tokens = int(prefill_dequant_min_tokens)
        self.permuted_x = fk.PERMUTED_X_DEFAULT if permuted_x is None else bool(permuted_x)
        self.cache_multiple = max(1, int(cache_multiple))
        self._plan: _Plan | None = None
        self._state: _State | None = None
        self._pool = None
        self.last_stats: dict = {}
        self.max_decode_steps: int | None = None  # benchmark warm-ups: stop early

    # -- plan ---------------------------------------------------------------------------------

    def _backend_for(self, plan: _Plan) -> str:
        if self.backend != "auto":
            return self.backend
        if plan.device.type == "cuda" and HAS_TRITON and plan.dtype == torch.bfloat16:
            return "triton"
        return "torch"

    def _get_plan(self, model: nn.Module) -> _Plan:
        """The cached plan if nothing it references changed (same tensors, same adapters)."""
        new = build_plan(model, self.permuted_x)
        old = self._plan
        if old is not None and old.model_id == new.model_id and old.signature == new.signature \
                and old.adapters == new.adapters:
            return old
        self._plan = new
        self._state = None  # graphs hold pointers into the old plan
        return new

    # -- public API ---------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, model: nn.Module, prompt_ids: list[list[int]], sampling: SamplingParams,
                 generator: torch.Generator | None = None) -> RolloutBatch:
        if not prompt_ids:
            raise ValueError("generate needs at least one prompt")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("fast engine: empty prompts are not supported")
        was_training = model.training
        model.eval()
        try:
            return self._generate(model, prompt_ids, sampling, generator)
        finally:
            model.train(was_training)

    def _generate(self, model, prompt_ids, sp: SamplingParams, generator) -> RolloutBatch:
        t0 = time.perf_counter()
        plan = self._get_plan(model)
        backend = self._backend_for(plan)
        dev = plan.device
        _refresh_lora(plan)
        n = sp.n
        n_prompts = len(prompt_ids)
        N = n_prompts * n
        T = sp.max_new_tokens
        lens = [len(p) for p in prompt_ids]
        P = max(lens)
        need = P + T
        mode = "greedy" if sp.greedy else ("full" if sp.top_p >= 1.0 else "top_p")

        # uniforms for sampling: one per row and step, from the caller's generator
        if generator is not None:
            u = torch.rand((T, N), generator=generator, device=generator.device,
                           dtype=torch.float32).to(dev)
        else:
            u = torch.rand((T, N), device=dev, dtype=torch.float32)

        st = self._get_state(plan, N, need, T, mode, backend)
        ids = torch.full((n_prompts, P), sp.pad_token_id, dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(dev)
        pad_p = torch.tensor([P - x for x in lens], dtype=torch.long, device=dev)
        pad_rows = pad_p.repeat_interleave(n)

        # static scalars
        st.temp.fill_(1.0 if sp.greedy else float(sp.temperature))
        st.top_p.fill_(float(sp.top_p))
        st.pad_id.fill_(int(sp.pad_token_id))
        eos = (list(sp.eos_token_ids) or [-1])[: st.eos.numel()]
        if len(sp.eos_token_ids) > st.eos.numel():
            raise ValueError(f"fast engine: at most {st.eos.numel()} EOS ids are supported")
        st.eos.fill_(-1)
        st.eos[: len(eos)] = torch.tensor(eos, dtype=torch.long)
        st.u.zero_()
        st.u[:T].copy_(u)
        st.out_tok.fill_(int(sp.pad_token_id))
        st.out_lp.zero_()
        st.out_mask.zero_()
        st.out_ent.zero_()
        st.pad.copy_(pad_rows.to(st.pad.dtype))

        # ---- prefill (unique prompts), then the KV rows are replicated n times
        if plan.device.type == "cuda":
            torch.cuda.synchronize()
        tp0 = time.perf_counter()
        logits = self._prefill(plan, st, ids, pad_p, n, backend)
        logits = logits.repeat_interleave(n, dim=0) if n > 1 else logits
        tok, lp, ent = sample_tokens(logits, st.u[0], st.temp, st.top_p, mode)
        st.out_tok[:, 0] = tok
        st.out_lp[:, 0] = lp
        st.out_ent[:, 0] = ent
        st.out_mask[:, 0] = 1.0
        st.done.copy_((tok.unsqueeze(-1) == st.eos.unsqueeze(0)).any(-1))
        st.tok.copy_(tok)
        st.slot.fill_(P)
        st.step.fill_(1)
        if plan.device.type == "cuda":
            torch.cuda.synchronize()
        tp1 = time.perf_counter()

        # ---- decode
        steps = 0
        if T > 1 and not bool(st.done.all()):
            if backend == "triton":
                steps = self._decode_triton(plan, st, T)
            else:
                steps = self._decode_torch(plan, st, T, P, mode)
        if plan.device.type == "cuda":
            torch.cuda.synchronize()
        tp2 = time.perf_counter()
        for g in plan.groups():
            for m in g.members:
                m.deq_cache = None

        # ---- outputs
        mask = st.out_mask[:, :T].float()
        used = int(mask.any(0).nonzero().max().item()) + 1 if bool(mask.any()) else 1
        done = st.done.clone()
        out_tok = st.out_tok[:, :used].clone()
        out_lp = (st.out_lp[:, :used] * mask[:, :used]).clone()
        out_ent = (st.out_ent[:, :used] * mask[:, :used]).clone()
        mask = mask[:, :used].clone()
        if not sp.eos_token_ids:
            done.zero_()
        self.last_stats = {
            "backend": backend, "rows": N, "prompt_len": P, "decode_steps": steps,
            "prefill_s": tp1 - tp0, "decode_s": tp2 - tp1, "total_s": time.perf_counter() - t0,
            "cuda_graph": st.graph is not None,
        }
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids for _ in range(n)],
            completion_ids=out_tok.cpu(),
            completion_mask=mask.cpu(),
            logprobs=out_lp.cpu(),
            truncated=(~done).cpu(),
            prompt_index=torch.arange(n_prompts).repeat_interleave(n),
            extras={"entropy": out_ent.cpu(), "engine_stats": dict(self.last_stats)},
        )

    # -- state --------------------------------------------------------------------------------

    def _get_state(self, plan: _Plan, N: int, need: int, T: int, mode: str, backend: str) -> _State:
        st = self._state
        if st is not None and st.n_rows == N and st.cap >= need and st.t_cap == T \
                and st.mode == mode and st.key == (plan.signature, backend):
            return st
        self._state = None
        st = None
        if plan.device.type == "cuda":
            torch.cuda.empty_cache()
        cap = -(-need // self.cache_multiple) * self.cache_multiple
        dev, dt = plan.device, plan.dtype
        shape = (N, plan.n_kv, cap, plan.head_dim)
        kc = [torch.zeros(shape, dtype=dt, device=dev) for _ in plan.layers]
        vc = [torch.zeros(shape, dtype=dt, device=dev) for _ in plan.layers]
        st = _State(
            key=(plan.signature, backend), n_rows=N, cap=cap, t_cap=T, mode=mode, k=kc, v=vc,
            tok=torch.zeros(N, dtype=torch.long, device=dev),
            slot=torch.zeros(1, dtype=torch.int32, device=dev),
            step=torch.zeros(1, dtype=torch.long, device=dev),
            pad=torch.zeros(N, dtype=torch.int32, device=dev),
            done=torch.zeros(N, dtype=torch.bool, device=dev),
            u=torch.zeros(T + 1, N, dtype=torch.float32, device=dev),
            temp=torch.ones(1, dtype=torch.float32, device=dev),
            top_p=torch.ones(1, dtype=torch.float32, device=dev),
            eos=torch.full((8,), -1, dtype=torch.long, device=dev),
            pad_id=torch.zeros(1, dtype=torch.long, device=dev),
            out_tok=torch.zeros(N, T + 1, dtype=torch.long, device=dev),
            out_lp=torch.zeros(N, T + 1, dtype=torch.float32, device=dev),
            out_mask=torch.zeros(N, T + 1, dtype=torch.float32, device=dev),
            out_ent=torch.zeros(N, T + 1, dtype=torch.float32, device=dev),
        )
        self._state = st
        return st

    # -- linear layers ------------------------------------------------------------------------

    def _base_torch(self, plan: _Plan, m: _Member, x: torch.Tensor, backend: str) -> torch.Tensor:
        if m.kind == "dense":
            return F.linear(x, m.weight, m.bias)
        if m.kind == "module":
            return m.module(x).to(x.dtype)
        # fp4
        tokens = x.numel() // x.shape[-1]
        if backend == "triton" and x.is_cuda:
            if tokens >= self.prefill_dequant_min_tokens:
                w = fk.fp4_dequantize_triton(m.packed, m.scale, m.fmt, m.gscale, dtype=x.dtype)
                return F.linear(x, w, m.bias)
            return fk.fp4_linear(x, m.packed, m.scale, m.fmt, m.gscale, m.bias)
        if m.deq_cache is None:
            m.deq_cache = fk.dequantize_fp4(m.packed, m.scale, m.fmt, m.gscale, dtype=x.dtype)
        return F.linear(x, m.deq_cache, m.bias.to(x.dtype) if m.bias is not None else None)

    def _group_torch(self, plan: _Plan, g: _Group, x: torch.Tensor, backend: str) -> list:
        xa = x @ g.a_nat.t() if g.r_total else None
        outs = []
        for m in g.members:
            y = self._base_torch(plan, m, x, backend)
            if m.lora_r:
                y = y + xa[..., m.lora_off:m.lora_off + m.lora_r] @ m.b_shadow.t()
            outs.append(y)
        return outs

    # -- torch forward (CPU decode, and prefill on every device) ------------------------------

    @staticmethod
    def _rmsnorm_torch(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        dt = h.dtype
        hf = h.to(torch.float32)
        var = hf.pow(2).mean(-1, keepdim=True)
        hf = hf * torch.rsqrt(var + eps)
        return w * hf.to(dt)

    def _rope_torch(self, plan: _Plan, pos: torch.Tensor, dt: torch.dtype):
        inv = plan.inv_freq.to(torch.float32)
        freqs = pos.to(torch.float32).unsqueeze(-1) * inv  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * plan.rope_scale).to(dt), (emb.sin() * plan.rope_scale).to(dt)

    @staticmethod
    def _rot_half(x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], dim=-1)

    def _forward_torch(self, plan: _Plan, ids: torch.Tensor, start: int, pad: torch.Tensor,
                       kc: list, vc: list, backend: str) -> torch.Tensor:
        """Run tokens ``ids [B, T]`` occupying cache slots ``start .. start+T-1``; returns the
        logits of the last position ``[B, V]``. ``pad [B]``: left-pad count of each row."""
        B, T = ids.shape
        Hq, Hkv, D = plan.n_heads, plan.n_kv, plan.head_dim
        S = start + T
        slots = torch.arange(start, S, device=ids.device)
        pos = (slots.unsqueeze(0) - pad.unsqueeze(1)).clamp_min(0)  # [B, T]
        cos, sin = self._rope_torch(plan, pos, plan.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        keys = torch.arange(S, device=ids.device)
        allowed = (keys.view(1, 1, S) >= pad.view(B, 1, 1)) & (keys.view(1, 1, S) <= slots.view(1, T, 1))
        allowed = allowed | (keys.view(1, 1, S) == slots.view(1, T, 1))  # pad queries see themselves
        allowed = allowed.unsqueeze(1)  # [B, 1, T, S]
        h = F.embedding(ids, plan.embed)
        for li, L in enumerate(plan.layers):
            x = self._rmsnorm_torch(h, L.ln1, L.eps1)
            q, k, v = self._group_torch(plan, L.qkv, x, backend)
            q = q.view(B, T, Hq, D).transpose(1, 2)
            k = k.view(B, T, Hkv, D).transpose(1, 2)
            v = v.view(B, T, Hkv, D).transpose(1, 2)
            q = q * cos + self._rot_half(q) * sin
            k = k * cos + self._rot_half(k) * sin
            kc[li][:, :, start:S] = k
            vc[li][:, :, start:S] = v
            K, Vv = kc[li][:, :, :S], vc[li][:, :, :S]
            if Hkv != Hq:
                K = K.repeat_interleave(Hq // Hkv, dim=1)
                Vv = Vv.repeat_interleave(Hq // Hkv, dim=1)
            if ids.is_cuda:
                a = F.scaled_dot_product_attention(q, K, Vv, attn_mask=allowed, scale=L.scaling)
            else:
                w = (q @ K.transpose(-1, -2)) * L.scaling
                w = w.masked_fill(~allowed, float("-inf"))
                w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
                a = w @ Vv
            a = a.transpose(1, 2).reshape(B, T, Hq * D)
            (o,) = self._group_torch(plan, L.o, a, backend)
            h = h + o
            x = self._rmsnorm_torch(h, L.ln2, L.eps2)
            g, u = self._group_torch(plan, L.gu, x, backend)
            (d,) = self._group_torch(plan, L.down, F.silu(g) * u, backend)
            h = h + d
        h = self._rmsnorm_torch(h[:, -1], plan.norm, plan.norm_eps)
        (logits,) = self._group_torch(plan, plan.lm_head, h, backend)
        return logits

    def _prefill(self, plan: _Plan, st: _State, ids: torch.Tensor, pad_p: torch.Tensor, n: int,
                 backend: str) -> torch.Tensor:
        P = ids.shape[1]
        if n == 1:
            kc, vc = st.k, st.v
        else:
            kc = [k[::n] for k in st.k]
            vc = [v[::n] for v in st.v]
        logits = self._forward_torch(plan, ids, 0, pad_p, kc, vc, backend)
        if n > 1:
            for k, v in zip(st.k, st.v, strict=True):
                kv = k.view(-1, n, *k.shape[1:])
                kv[:, 1:, :, :P] = kv[:, :1, :, :P]
                vv = v.view(-1, n, *v.shape[1:])
                vv[:, 1:, :, :P] = vv[:, :1, :, :P]
        return logits

    # -- decode: torch backend ----------------------------------------------------------------

    def _record(self, st: _State, tok, lp, ent) -> None:
        live = ~st.done
        tok = torch.where(live, tok, st.pad_id.expand_as(tok))
        idx = st.step
        st.out_tok.index_copy_(1, idx, tok.unsqueeze(1))
        st.out_lp.index_copy_(1, idx, (lp * live).unsqueeze(1))
        st.out_ent.index_copy_(1, idx, (ent * live).unsqueeze(1))
        st.out_mask.index_copy_(1, idx, live.to(st.out_mask.dtype).unsqueeze(1))
        st.done.logical_or_((tok.unsqueeze(-1) == st.eos.unsqueeze(0)).any(-1))
        st.tok.copy_(tok)

    def _decode_torch(self, plan: _Plan, st: _State, T: int, P: int, mode: str) -> int:
        steps = 0
        pad = st.pad.long()
        for t in range(1, T):
            slot = P + t - 1
            logits = self._forward_torch(plan, st.tok.unsqueeze(1), slot, pad, st.k, st.v, "torch")
            u = st.u.index_select(0, st.step).squeeze(0)
            tok, lp, ent = sample_tokens(logits, u, st.temp, st.top_p, mode)
            self._record(st, tok, lp, ent)
            st.slot.add_(1)
            st.step.add_(1)
            steps += 1
            if t % self.check_every == 0 and bool(st.done.all()):
                break
        return steps

    # -- decode: triton backend ---------------------------------------------------------------

    def _lin_dec(self, m: _Member, x: torch.Tensor, xa, perm_in: bool, perm_out: bool = False):
        lxa = xa[:, m.lora_off:m.lora_off + m.lora_r] if m.lora_r else None
        if m.kind == "fp4":
            return fk.fp4_linear_triton(x, m.packed, m.scale, m.fmt, m.gscale, m.bias,
                                        lora_xa=lxa, lora_b=m.b_shadow if m.lora_r else None,
                                        x_permuted=perm_in, out_permuted=perm_out,
                                        use_asm=None if x.dtype == torch.bfloat16 else False)
        xin = fk.unpermute_activation(x) if perm_in else x
        if m.kind == "dense":
            y = F.linear(xin, m.weight, m.bias)
        else:
            y = m.module(xin).to(x.dtype)
        if m.lora_r:
            y = y.addmm(lxa, m.b_shadow.t())
        if perm_out:
            y = fk.permute_activation(y)
        return y

    def _group_dec(self, g: _Group, x: torch.Tensor) -> list:
        xa = None
        if g.r_total:
            xa = x @ (g.a_perm if g.perm else g.a_nat).t()
        return [self._lin_dec(m, x, xa, g.perm) for m in g.members]

    def _step_triton(self, plan: _Plan, st: _State) -> None:
        """One decode step on static buffers (what the CUDA graph captures)."""
        N = st.n_rows
        Hq, Hkv, D = plan.n_heads, plan.n_kv, plan.head_dim
        G = Hq // Hkv
        h = F.embedding(st.tok, plan.embed)
        d = None
        for li, L in enumerate(plan.layers):
            x = _add_rmsnorm(h, d, L.ln1, L.eps1, L.qkv.perm)
            q, k, v = self._group_dec(L.qkv, x)
            qr = torch.empty((N, Hq, D), dtype=q.dtype, device=q.device)
            kc, vc = st.k[li], st.v[li]
            _rope_cache_kernel[(N, Hq + Hkv)](
                q, k, v, qr, kc, vc, plan.inv_freq, st.slot, st.pad,
                q.stride(0), k.stride(0), v.stride(0), kc.stride(0), kc.stride(1), kc.stride(2),
                plan.rope_scale, HQ=Hq, D=D, HALF=D // 2, HALFP=_np2(D // 2), num_warps=1)
            ao = torch.empty((N, Hq * D), dtype=q.dtype, device=q.device)
            _attn_decode_kernel[(N, Hkv)](
                qr, kc, vc, ao, st.slot, st.pad, L.scaling * 1.4426950408889634,
                kc.stride(0), kc.stride(1), kc.stride(2), ao.stride(0),
                HQ=Hq, G=G, GP=max(16, _np2(G)), D=D, DP=max(16, _np2(D)), BL=64,
                PERM=L.o.perm, num_warps=4)
            (o,) = self._group_dec(L.o, ao)
            x = _add_rmsnorm(h, o, L.ln2, L.eps2, L.gu.perm)
            gm, um = L.gu.members
            if L.gu.all_fp4 and gm.fmt == um.fmt and gm.lora_r == um.lora_r \
                    and (gm.bias is None) == (um.bias is None):
                xa = x @ (L.gu.a_perm if L.gu.perm else L.gu.a_nat).t() if L.gu.r_total else None
                gu = None
                if gm.lora_r:
                    gu = {"packed": um.packed, "scale": um.scale, "global_scale": um.gscale,
                          "bias": um.bias, "lora_xa": xa[:, um.lora_off:um.lora_off + um.lora_r],
                          "lora_b": um.b_shadow}
                else:
                    gu = {"packed": um.packed, "scale": um.scale, "global_scale": um.gscale,
                          "bias": um.bias}
                act = fk.fp4_linear_triton(
                    x, gm.packed, gm.scale, gm.fmt, gm.gscale, gm.bias,
                    lora_xa=xa[:, gm.lora_off:gm.lora_off + gm.lora_r] if gm.lora_r else None,
                    lora_b=gm.b_shadow if gm.lora_r else None, gate_up=gu,
                    x_permuted=L.gu.perm, out_permuted=L.down.perm,
                    use_asm=None if x.dtype == torch.bfloat16 else False)
            else:
                g_, u_ = self._group_dec(L.gu, x)
                act = (F.silu(g_) * u_).to(x.dtype)
                if L.down.perm:
                    act = fk.permute_activation(act)
            (d,) = self._group_dec(L.down, act)
        x = _add_rmsnorm(h, d, plan.norm, plan.norm_eps, False)
        (logits,) = self._group_dec(plan.lm_head, x)
        u = st.u.index_select(0, st.step).squeeze(0)
        tok, lp, ent = sample_tokens(logits, u, st.temp, st.top_p, st.mode)
        self._record(st, tok, lp, ent)
        st.slot.add_(1)
        st.step.add_(1)

    def _decode_triton(self, plan: _Plan, st: _State, T: int) -> int:
        use_graph = self.use_cuda_graph and plan.device.type == "cuda"
        if use_graph and st.graph is None:
            self._capture(plan, st)
        steps = 0
        for t in range(1, T):
            if self.max_decode_steps is not None and steps >= self.max_decode_steps:
                break
            if st.graph is not None:
                st.graph.replay()
            else:
                self._step_triton(plan, st)
            steps += 1
            if t % self.check_every == 0 and bool(st.done.all()):
                break
        return steps

    def _capture(self, plan: _Plan, st: _State) -> None:
        """Warm up (compiles the Triton kernels) and capture one decode step as a CUDA graph."""
        max_n = max(m.out_f for g in plan.groups() for m in g.members)
        fk.reserve_workspace(plan.device, st.n_rows, max_n)
        saved = [t.clone() for t in (st.tok, st.slot, st.step, st.done, st.out_tok, st.out_lp,
                                     st.out_mask, st.out_ent)]
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    self._restore(st, saved)
                    self._step_triton(plan, st)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            self._restore(st, saved)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._step_triton(plan, st)
            torch.cuda.synchronize()
            st.graph = g
        except Exception as e:  # pragma: no cover - depends on the GPU stack
            warnings.warn(f"fast engine: CUDA graph capture failed ({e!r}); decoding eagerly",
                          stacklevel=3)
            st.graph = None
        finally:
            self._restore(st, saved)

    @staticmethod
    def _restore(st: _State, saved: list) -> None:
        for dst, src in zip((st.tok, st.slot, st.step, st.done, st.out_tok, st.out_lp,
                             st.out_mask, st.out_ent), saved, strict=True):
            dst.copy_(src)


#: alias (the issue calls it the fast rollout engine)
FastRolloutEngine = FastEngine
