"""Static decode state: every buffer a decode step reads or writes, allocated once per
(plan, rows, capacity) so that a CUDA graph captured over it can be replayed for every wave."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from qerl.rollout.base import SamplingParams
from qerl.rollout.fast.attention import attention_splits
from qerl.rollout.fast.plan import Plan

__all__ = ["State", "new_state", "pad_cols", "record", "reset_outputs", "sync", "uniforms",
           "wave_rows"]

_STEP_FIELDS = ("tok", "slot", "step", "done", "out_tok", "out_lp", "out_mask", "out_ent")


@dataclass
class State:
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
    lora_xa: dict = field(default_factory=dict)  # per group kind: flat [rows * R] shrink buffer
    lora_out: dict = field(default_factory=dict)  # per group kind: [rows, N] LoRA output
    # per group kind with adapters: the fused kernel's (LoraLaunch, float32 accumulator, counters);
    # None: the LoRA runs as cuBLAS GEMMs
    lora_fused: dict | None = None
    attn_splits: int = 1  # splits of each row's KV slots in the decode attention
    attn_cnt: torch.Tensor | None = None  # its int32 counters [rows * KV heads] (zeros between)
    pdl: bool = False  # decode kernels with programmatic dependent launch (pdl.pdl_supported)
    gemm_sms: int | None = None  # humming's multiprocessors when the fused LoRA runs beside it
    lora_end_wait: str = "one"  # beside the GEMM: which LoRA programs wait at their end
    lora_in_gemv: bool = False  # a group's LoRA inside its FP4 GEMV launch where it runs one
    side: torch.cuda.Stream | None = None
    graph: object = None

    def snapshot(self) -> list[torch.Tensor]:
        return [getattr(self, f).clone() for f in _STEP_FIELDS]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for f, src in zip(_STEP_FIELDS, saved, strict=True):
            getattr(self, f).copy_(src)

    def nbytes(self) -> int:
        ts = self.k + self.v + list(self.lora_xa.values()) + list(self.lora_out.values()) \
            + [acc for _, acc, _ in (self.lora_fused or {}).values()] \
            + ([self.attn_cnt] if self.attn_cnt is not None else [])
        return sum(t.numel() * t.element_size() for t in ts)


def _lora_buffers(plan: Plan, rows: int, dev: torch.device) -> tuple[dict, dict]:
    """Per group kind with adapters (shared by all layers): a flat buffer for the shrink
    ``x a_cat^T`` of the largest rank (viewed as ``[rows, R]`` per layer) and the group's LoRA
    output ``[rows, N]``, both in the model dtype."""
    xa, out = {}, {}
    for kind in ("qkv", "o", "gu", "down"):
        r = max(getattr(lay, kind).r_total for lay in plan.layers)
        if r:
            n = getattr(plan.layers[0], kind).out_f
            xa[kind] = torch.zeros(rows * r, dtype=plan.dtype, device=dev)
            out[kind] = torch.zeros((rows, n), dtype=plan.dtype, device=dev)
    return xa, out


def _fused_lora(plan: Plan, rows: int, dev: torch.device) -> dict | None:
    """The fused LoRA kernel's launch, accumulator and counters per group kind (one set per
    kind: every launch on a set has the same programs), when it takes this many rows and every
    layer's group of a kind has the same shape (else ``None``)."""
    from qerl.rollout.fast.lora import MAX_ROWS, LoraLaunch

    if rows > MAX_ROWS:
        return None
    fused = {}
    for kind in ("qkv", "o", "gu", "down"):
        shapes = {(tuple(m.out_f for m in g.members), tuple(m.lora_r for m in g.members), g.in_f)
                  for g in (getattr(lay, kind) for lay in plan.layers)}
        if len(shapes) != 1:
            return None
        out_f, ranks, in_f = shapes.pop()
        if sum(ranks):
            lau = LoraLaunch(list(out_f), list(ranks), in_f, dev)
            fused[kind] = (lau, torch.zeros(lau.acc_numel(rows), device=dev),
                           torch.zeros(2, dtype=torch.int64, device=dev))
    return fused


def new_state(plan: Plan, key: tuple, rows: int, cap: int, T: int, mode: str,
              side: torch.cuda.Stream | None, attn_splits: int | None = None,
              fused_lora: bool = False) -> State:
    """Buffers for ``rows`` rows and ``cap`` KV slots; ``side``: the LoRA side stream (the
    engine's one stream: cuBLAS keeps a workspace per stream it has run on, for the process);
    ``attn_splits``: the decode attention's splits (``None``: :func:`attention_splits`);
    ``fused_lora``: LoRA through :mod:`qerl.rollout.fast.lora` where it applies."""
    dev, dt = plan.device, plan.dtype
    shape = (rows, plan.n_kv, cap, plan.head_dim)

    def z(*s, dtype=torch.float32):
        return torch.zeros(s, dtype=dtype, device=dev)

    xa, lo = _lora_buffers(plan, rows, dev)
    fused = _fused_lora(plan, rows, dev) if fused_lora and lo else None
    if attn_splits is None:
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 8
        attn_splits = attention_splits(rows, plan.n_kv, cap, sms)
    return State(
        key=key, n_rows=rows, cap=cap, t_cap=T, mode=mode,
        k=[torch.zeros(shape, dtype=dt, device=dev) for _ in plan.layers],
        v=[torch.zeros(shape, dtype=dt, device=dev) for _ in plan.layers],
        tok=z(rows, dtype=torch.long), slot=z(1, dtype=torch.int32), step=z(1, dtype=torch.long),
        pad=z(rows, dtype=torch.int32), done=z(rows, dtype=torch.bool), u=z(T + 1, rows),
        temp=torch.ones(1, device=dev), top_p=torch.ones(1, device=dev),
        eos=torch.full((8,), -1, dtype=torch.long, device=dev), pad_id=z(1, dtype=torch.long),
        out_tok=z(rows, T + 1, dtype=torch.long), out_lp=z(rows, T + 1),
        out_mask=z(rows, T + 1), out_ent=z(rows, T + 1), lora_xa=xa, lora_out=lo,
        lora_fused=fused,
        attn_splits=attn_splits, attn_cnt=z(rows * plan.n_kv, dtype=torch.int32), side=side)


def reset_outputs(st: State, sp: SamplingParams, u: torch.Tensor, pad_rows: torch.Tensor) -> None:
    """Load a wave's sampling settings, uniforms ``u [T, rows]`` and pad counts; clear outputs."""
    st.temp.fill_(1.0 if sp.greedy else float(sp.temperature))
    st.top_p.fill_(float(sp.top_p))
    st.pad_id.fill_(int(sp.pad_token_id))
    st.eos.fill_(-1)
    if sp.eos_token_ids:
        st.eos[: len(sp.eos_token_ids)] = torch.tensor(sp.eos_token_ids, dtype=torch.long)
    st.u.zero_()
    st.u[: u.shape[0]].copy_(u)
    st.out_tok.fill_(int(sp.pad_token_id))
    for t in (st.out_lp, st.out_mask, st.out_ent):
        t.zero_()
    st.pad.copy_(pad_rows.to(st.pad.dtype))


def record(st: State, tok: torch.Tensor, lp: torch.Tensor, ent: torch.Tensor) -> None:
    """Store one step's samples (finished rows get the pad token and zero log-prob / mask)."""
    live = ~st.done
    tok = torch.where(live, tok, st.pad_id.expand_as(tok))
    idx = st.step
    st.out_tok.index_copy_(1, idx, tok.unsqueeze(1))
    st.out_lp.index_copy_(1, idx, (lp * live).unsqueeze(1))
    st.out_ent.index_copy_(1, idx, (ent * live).unsqueeze(1))
    st.out_mask.index_copy_(1, idx, live.to(st.out_mask.dtype).unsqueeze(1))
    st.done.logical_or_((tok.unsqueeze(-1) == st.eos.unsqueeze(0)).any(-1))
    st.tok.copy_(tok)


def sync(dev: torch.device) -> None:
    """Wait for ``dev`` (CUDA; no-op elsewhere)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def pad_cols(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """``t [rows, w]`` padded with ``value`` to ``width`` columns (a wave's outputs)."""
    if t.shape[1] == width:
        return t
    return torch.cat([t, torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)], 1)


SAMPLING_BYTES_PER_LOGIT = 32  # float32 logits, softmax, sorted copy, int64 order, cumsum


def uniforms(generator, T: int, n: int, N: int, dev: torch.device) -> torch.Tensor:
    """The sampling uniforms ``[T, N]`` of a call, one a row and step whatever the waves;
    ``generator`` a list: one generator a prompt, for its ``n`` rows."""
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.rand((T, n), generator=g, device=g.device).to(dev)
                          for g in generator], dim=1)
    if generator is not None:
        return torch.rand((T, N), generator=generator, device=generator.device).to(dev)
    return torch.rand((T, N), device=dev)


def wave_rows(plan: Plan, n_rows: int, slots: int, group: int, budget_gib: float | None,
              fraction: float, held: int = 0) -> int:
    """Rows per wave: all of them if their KV cache and sampling buffers fit the budget
    (``budget_gib``, else ``fraction`` of the free device memory plus what the caching allocator
    and the engine's current state ``held``; no limit on the CPU), else as many as fit (whole
    prompt groups of ``group`` rows when at least one group fits)."""
    per_row = plan.kv_bytes_per_row(slots) + SAMPLING_BYTES_PER_LOGIT * plan.vocab
    if budget_gib is not None:
        budget = budget_gib * (1 << 30)
    elif plan.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(plan.device)
        cached = torch.cuda.memory_reserved(plan.device) - torch.cuda.memory_allocated(plan.device)
        budget = fraction * (free + cached + held)
    else:
        return n_rows
    rows = min(n_rows, max(1, int(budget // per_row)))
    return rows if rows < group or rows == n_rows else rows // group * group
