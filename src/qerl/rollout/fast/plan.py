"""The fast engine's plan of a model: live references to everything a rollout reads.

The decoder (Qwen2 / Llama style: RMSNorm, RoPE from the model's rotary module, GQA, SiLU MLP,
optional q/k/v bias, tied or untied LM head) is unwrapped from a peft ``PeftModel`` if needed.
Projections that share an input form a :class:`Group` (q/k/v, o, gate/up, down, lm_head); each
member is a ``QuantLinear`` (``kind="fp4"``), a float ``nn.Linear`` (``"dense"``) or any other
module called as is (``"module"``, e.g. bitsandbytes), plus its active, unmerged peft LoRA
adapters.

LoRA, batched per group: the members' ``A`` matrices are stacked into one ``a_cat [R, K]`` (one
shrink GEMM per group) and their ``B`` matrices (scaling folded in) into one block-diagonal
``b_full [N, R]`` (one expand GEMM per group); ``y = base(x) + (x a_cat^T) b_full^T`` equals the
per-adapter sum because the off-diagonal blocks are zero. These are compute-dtype copies made at
the start of every ``generate`` call (:func:`refresh_lora`); everything else is read live.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from qerl.quant.formats import FP4_FORMATS

__all__ = ["Group", "Layer", "Member", "Plan", "build_plan", "refresh_lora"]


@dataclass
class Member:
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
    lora: list = field(default_factory=list)  # [(A [r, in], B [out, r], scaling)]
    lora_r: int = 0

    def tensors(self) -> list[torch.Tensor]:
        ts = [t for t in (self.bias, self.weight, self.packed, self.scale, self.gscale)
              if t is not None]
        for a, b, _ in self.lora:
            ts += [a, b]
        return ts

    def fp4_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        return self.packed, self.scale, self.gscale


@dataclass
class Group:
    """Projections that share one input; outputs side by side in member order."""

    members: list[Member]
    r_total: int = 0
    a_cat: torch.Tensor | None = None  # [R, K] compute dtype
    b_full: torch.Tensor | None = None  # [N, R] compute dtype, block diagonal, scaling folded in
    bias: torch.Tensor | None = None  # [N] compute dtype (zeros for members without one)

    @property
    def in_f(self) -> int:
        return self.members[0].in_f

    @property
    def out_f(self) -> int:
        return sum(m.out_f for m in self.members)

    @property
    def offsets(self) -> list[int]:
        out, o = [], 0
        for m in self.members:
            out.append(o)
            o += m.out_f
        return out

    @property
    def all_fp4(self) -> bool:
        return all(m.kind == "fp4" for m in self.members) \
            and len({m.fmt for m in self.members}) == 1

    @property
    def has_bias(self) -> bool:
        return any(m.bias is not None and m.kind != "module" for m in self.members)


@dataclass
class Layer:
    ln1: torch.Tensor
    eps1: float
    ln2: torch.Tensor
    eps2: float
    qkv: Group
    o: Group
    gu: Group
    down: Group
    scaling: float


@dataclass
class Plan:
    model_id: int
    dtype: torch.dtype
    device: torch.device
    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    vocab: int
    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    norm_eps: float
    lm_head: Group
    inv_freq: torch.Tensor
    rope_scale: float
    signature: tuple
    adapters: tuple

    def groups(self):
        for lay in self.layers:
            yield from (lay.qkv, lay.o, lay.gu, lay.down)
        yield self.lm_head

    def kv_bytes_per_row(self, slots: int) -> int:
        """Bytes of K and V cache one row needs for ``slots`` positions."""
        return 2 * len(self.layers) * self.n_kv * slots * self.head_dim * self.dtype.itemsize


def _unwrap(model: nn.Module):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dec = getattr(base, "model", None)
    if dec is None or not hasattr(dec, "layers") or not hasattr(dec, "embed_tokens"):
        raise NotImplementedError(
            f"fast engine: {type(base).__name__} is not a Llama/Qwen2-style causal LM "
            "(expected .model.layers and .model.embed_tokens)")
    return base, dec, getattr(base, "lm_head", None) or base.get_output_embeddings()


def _lora_of(mod: nn.Module) -> tuple[nn.Module, list, tuple]:
    if not (hasattr(mod, "base_layer") and hasattr(mod, "lora_A")):
        return mod, [], ()
    lora, adapters = [], ()
    if not getattr(mod, "disable_adapters", False) and not getattr(mod, "merged", False):
        active = mod.active_adapters
        for a in [active] if isinstance(active, str) else active:
            if a not in mod.lora_A:
                continue
            if getattr(mod, "use_dora", {}).get(a, False):
                raise NotImplementedError("fast engine: DoRA adapters are not supported")
            s = float(mod.scaling[a])
            lora.append((mod.lora_A[a].weight, mod.lora_B[a].weight, s))
            adapters += ((a, s),)
    return mod.base_layer, lora, adapters


def _member(name: str, mod: nn.Module) -> tuple[Member, tuple]:
    base, lora, adapters = _lora_of(mod)
    if getattr(base, "fmt", None) in FP4_FORMATS and hasattr(base, "weight_packed"):
        m = Member(name, "fp4", base.in_features, base.out_features, base,
                   bias=getattr(base, "bias", None), fmt=base.fmt, packed=base.weight_packed,
                   scale=base.weight_scale, gscale=getattr(base, "weight_global_scale", None))
        if m.fmt == "nvfp4" and m.gscale is None:
            raise ValueError(f"{name}: NVFP4 layer without weight_global_scale")
    elif isinstance(base, nn.Linear) and isinstance(getattr(base, "weight", None), torch.Tensor) \
            and base.weight.is_floating_point() and type(base).__name__ != "Linear4bit":
        m = Member(name, "dense", base.in_features, base.out_features, base, bias=base.bias,
                   weight=base.weight)
    else:
        in_f, out_f = getattr(base, "in_features", None), getattr(base, "out_features", None)
        if in_f is None or out_f is None:
            raise NotImplementedError(f"fast engine: unsupported layer {name}: {type(base).__name__}")
        m = Member(name, "module", in_f, out_f, base)
    m.lora = lora
    m.lora_r = sum(a.shape[0] for a, _, _ in lora)
    return m, adapters


def _group(names_mods: list[tuple[str, nn.Module]]) -> tuple[Group, tuple]:
    members, adapters = [], ()
    for n, mod in names_mods:
        m, a = _member(n, mod)
        members.append(m)
        adapters += ((n, a),)
    g = Group(members)
    g.r_total = sum(m.lora_r for m in members)
    return g, adapters


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _check_supported(cfg, dec) -> nn.Module:
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise NotImplementedError("fast engine: sliding-window attention is not supported")
    act = getattr(cfg, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise NotImplementedError(f"fast engine: activation {act!r} is not supported")
    rot = getattr(dec, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        raise NotImplementedError("fast engine: the model has no rotary_emb.inv_freq")
    if getattr(rot, "rope_type", "default") == "dynamic":
        raise NotImplementedError("fast engine: dynamic RoPE scaling is not supported")
    return rot


def build_plan(model: nn.Module) -> Plan:
    """Walk ``model`` and collect live references to everything the engine reads."""
    base, dec, lm_head = _unwrap(model)
    cfg = base.config
    rot = _check_supported(cfg, dec)
    n_heads = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    layers, adapters = [], ()
    for i, layer in enumerate(dec.layers):
        at, mlp = layer.self_attn, layer.mlp
        if hasattr(at, "q_norm") or hasattr(at, "k_norm"):
            raise NotImplementedError("fast engine: q/k norms (Qwen3) are not supported")
        p = f"layers.{i}."
        qkv, a1 = _group([(p + "q_proj", at.q_proj), (p + "k_proj", at.k_proj),
                          (p + "v_proj", at.v_proj)])
        o, a2 = _group([(p + "o_proj", at.o_proj)])
        gu, a3 = _group([(p + "gate_proj", mlp.gate_proj), (p + "up_proj", mlp.up_proj)])
        down, a4 = _group([(p + "down_proj", mlp.down_proj)])
        adapters += a1 + a2 + a3 + a4
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        layers.append(Layer(ln1=ln1.weight, eps1=_eps(ln1), ln2=ln2.weight, eps2=_eps(ln2),
                            qkv=qkv, o=o, gu=gu, down=down,
                            scaling=float(getattr(at, "scaling", head_dim ** -0.5))))
    head, a5 = _group([("lm_head", lm_head)])
    embed = dec.embed_tokens.weight
    plan = Plan(model_id=id(model), dtype=embed.dtype, device=embed.device,
                hidden=cfg.hidden_size, n_heads=n_heads, n_kv=n_kv, head_dim=head_dim,
                vocab=embed.shape[0], embed=embed, layers=layers, norm=dec.norm.weight,
                norm_eps=_eps(dec.norm), lm_head=head, inv_freq=rot.inv_freq,
                rope_scale=float(getattr(rot, "attention_scaling", 1.0)), signature=(),
                adapters=adapters + a5)
    plan.signature = _signature(plan)
    return plan


def _signature(plan: Plan) -> tuple:
    """Storage of every tensor the plan references, plus the version counter of the FP4 buffers
    (which kernels keep prepared copies of); norm weights may change in place (AQN) freely."""
    ts = [plan.embed, plan.norm, plan.inv_freq]
    for lay in plan.layers:
        ts += [lay.ln1, lay.ln2]
    sig = [(t.data_ptr(), t.dtype, tuple(t.shape)) for t in ts]
    for g in plan.groups():
        for m in g.members:
            sig += [(t.data_ptr(), t.dtype, tuple(t.shape)) for t in m.tensors()]
            if m.kind == "fp4":
                sig += [t._version for t in m.fp4_tensors() if t is not None]
    return tuple(sig)


def refresh_lora(plan: Plan) -> None:
    """Copy the live adapter weights and biases into the groups' compute-dtype buffers (same
    storage across calls, so captured CUDA graphs keep reading them)."""
    dt, dev = plan.dtype, plan.device
    for g in plan.groups():
        if g.has_bias:
            bias = torch.cat([m.bias.detach().to(dev, torch.float32)
                              if m.bias is not None and m.kind != "module"
                              else torch.zeros(m.out_f, device=dev) for m in g.members])
            g.bias = _copy_into(g.bias, bias, dt)
        if not g.r_total:
            continue
        a_rows = [a.detach().to(dev, torch.float32) for m in g.members for a, _, _ in m.lora]
        b_full = torch.zeros(g.out_f, g.r_total, device=dev)
        row, col = 0, 0
        for m in g.members:
            for a, b, s in m.lora:
                b_full[row:row + m.out_f, col:col + a.shape[0]] = b.detach().to(dev,
                                                                                 torch.float32) * s
                col += a.shape[0]
            row += m.out_f
        g.a_cat = _copy_into(g.a_cat, torch.cat(a_rows), dt)
        g.b_full = _copy_into(g.b_full, b_full, dt)


def _copy_into(buf: torch.Tensor | None, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if buf is None or buf.shape != value.shape:
        buf = torch.empty(value.shape, dtype=dtype, device=value.device)
    buf.copy_(value)
    return buf
