"""The fast rollout engine: static KV cache, CUDA-graph decode, 4-bit GEMMs from humming.

Backends: ``triton`` (CUDA, bf16/fp16 models): prefill in eager torch (FP4 weights through the
selected 4-bit backend, :mod:`qerl.kernels`), then every decode step is one CUDA graph replay of
Triton kernels (RMSNorm fused with the residual add and the o / down epilogues, flash-decoding
attention with the q/k/v epilogue, RoPE and the cache write in its launch, SiLU-mul fused with the
gate/up epilogue), the group GEMMs (humming: q/k/v and gate/up each one GEMM), cuBLAS for dense weights
and the LM head, and sampling. ``torch`` (any device, no graphs): the same computation in plain
torch; the CPU tests run it against transformers.

LoRA is applied unmerged and batched per group (:mod:`qerl.rollout.fast.plan`): shrink and expand
in one launch (:mod:`qerl.rollout.fast.lora`; two cuBLAS GEMMs on a side stream above its rows, or
inside the FP4 GEMV's launch with ``lora_kernel="gemv"``) added by the consumer's epilogue.
Adapter weights are copied at the start of every ``generate``; norm weights are read live, so AQN
noise applied in place is seen by captured graphs; replaced tensors rebuild the plan.

Waves: when the KV cache of all rows does not fit the memory budget (``kv_budget_gib``, else
``kv_budget_fraction`` of the free device memory), rows run in waves of equal size (the last one
padded with copies of its last row). Sampling uniforms are drawn once for the whole batch, one a
row and step, so a row's result does not depend on how the batch was split.

Log-probs (:mod:`qerl.rollout.base`): ``log_softmax(logits / T)[token]``, top-p not renormalised.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from qerl.kernels.backend import resolve_backend
from qerl.kernels.humming_gemm import LAYOUTS
from qerl.rollout.base import RolloutBatch, SamplingParams
from qerl.rollout.fast import decode, state
from qerl.rollout.fast.gemm import GroupGemm, precompile_groups
from qerl.rollout.fast.kernels import HAS_TRITON
from qerl.rollout.fast.lora import FUSED_MAX_M, MAX_ROWS, fused_lora_ok
from qerl.rollout.fast.options import (
    beside_gemm_sms,
    bool_or_none,
    check_budget,
    choice,
    int_in,
    resolve_pdl,
)
from qerl.rollout.fast.plan import Plan, build_plan, refresh_lora
from qerl.rollout.fast.residency import HostParking, park_group
from qerl.rollout.fast.sampling import sample_tokens
from qerl.rollout.fast.state import State, new_state, pad_cols, record, reset_outputs, sync
from qerl.rollout.fast.torch_forward import TorchContext, forward_tokens

__all__ = ["FastEngine", "FastRolloutEngine"]

GiB = 1 << 30


class FastEngine:
    """Static-cache rollout engine (see the module docstring).

    Args:
        backend: ``auto`` (``triton`` on CUDA for bf16/fp16 models when Triton is installed, else
            ``torch``), ``triton`` or ``torch``.
        use_cuda_graph: capture the decode step as a CUDA graph (CUDA only).
        check_every: decode steps between checks of "all rows done" (early exit; one host sync).
        cache_multiple: KV capacity rounded up to this, so graphs are reused across calls.
        kv_budget_gib: memory for a wave's rows (KV cache, sampling buffers); ``None``: the
            ``kv_budget_fraction`` of the free device memory (CUDA) or no limit (CPU).
        lora_overlap: LoRA on a side stream (CUDA); ``None``: only the cuBLAS pair (it never
            overlapped humming's GEMMs; the fused kernel is faster without it).
        lora_kernel: ``"fused"``: a group's LoRA in decode as one launch of
            :func:`qerl.rollout.fast.lora.fused_lora` where it applies (the ``triton`` backend, at
            most ``fused_lora_max_rows`` rows a wave, the kernel's first-use check passed);
            ``"gemv"``: the same, but inside the FP4 GEMV's launch where the GEMV runs the group
            (:mod:`qerl.kernels.fp4_gemv_lora`; 0.1 ms slower a 7B B=1 step on the H100, run 83);
            ``"cublas"``: two cuBLAS GEMMs a group always.
        fused_lora_max_rows: the most rows of a wave for the fused LoRA (1 to ``lora.MAX_ROWS``).
        humming_layout: humming's copy of NVFP4 (:mod:`qerl.kernels.humming_gemm`): ``"ct"``
            (E4M3 group scales, as stored) or ``"bf16_scales"`` (bf16 ones; 3-4 % faster).
        attention_splits: splits of each row's KV slots in the decode attention (flash-decoding;
            the ``triton`` backend); ``None`` picks them from the rows, KV heads, capacity and
            multiprocessors (:func:`qerl.rollout.fast.attention.attention_splits`).
        keep_state: keep the KV cache, sampling buffers and captured graph between calls (a
            benchmark's); by default they go when ``generate`` returns, back to the trainer's
            update (the plan and the prepared 4-bit GEMM tensors are kept either way).
        single_copy: hold the 4-bit weights once on the GPU (:mod:`qerl.rollout.fast.residency`):
            humming's copies exist only during ``generate`` (every row count runs through them)
            while the trainer's buffers wait in pinned host memory; costs one host round trip of
            the 4-bit weights and humming's preparation a call. For models whose two copies would
            not fit (32B and larger on one GPU).
        pdl: launch the decode step's Triton kernels and humming's GEMMs with programmatic
            dependent launch (:mod:`qerl.rollout.fast.pdl`); ``None``: where supported
            (Hopper or later, compiled Triton, ``QERL_PDL`` not ``0``); ``True`` elsewhere raises.
        lora_sms: with PDL and the fused LoRA on the main stream, humming's decode GEMMs leave
            this many multiprocessors to the group's LoRA, which runs beside the GEMM (0: before
            it; 8: the fastest of 0 / 8 / 16 and 4 / 8 / 12, runs 38 and 40); ``lora_end_wait``:
            ``"one"`` or ``"all"`` of its programs wait for the GEMM at their end
            (:func:`qerl.rollout.fast.lora.fused_lora`; "one": 1.5-2 % faster, runs 39-40).
        gemv_max_m: decode waves of at most this many rows (0: off; up to 8; measured at 1) run
            4-bit GEMMs through our FP4 GEMV (:mod:`qerl.kernels.fp4_gemv`, reading the weights in
            place; not with ``single_copy``; 7B B=1, H100: 2.91 -> 2.74 ms a step) where K is
            short, and with ``gemv_long_k`` the long-K groups too (the down projection: K split
            over CTAs, :func:`qerl.kernels.fp4_gemv.default_split_k`).
    """

    name = "fast"

    def __init__(self, backend: str = "auto", use_cuda_graph: bool = True, check_every: int = 16,
                 cache_multiple: int = 128, kv_budget_gib: float | None = None,
                 kv_budget_fraction: float = 0.85, lora_overlap: bool | None = None,
                 keep_state: bool = False, single_copy: bool = False,
                 attention_splits: int | None = None, lora_kernel: str = "fused",
                 fused_lora_max_rows: int = FUSED_MAX_M, humming_layout: str = "bf16_scales",
                 pdl: bool | None = None, lora_sms: int = 8, lora_end_wait: str = "one",
                 gemv_max_m: int = 1, gemv_long_k: bool = False) -> None:
        choice("backend", backend, ("auto", "triton", "torch"))
        choice("lora_kernel", lora_kernel, ("fused", "gemv", "cublas"))
        choice("humming_layout", humming_layout, LAYOUTS)
        int_in("fused_lora_max_rows", fused_lora_max_rows, MAX_ROWS)
        int_in("attention_splits", 64 if attention_splits is None else attention_splits, 64)
        bool_or_none("pdl", pdl)
        int_in("lora_sms", lora_sms, 64, lo=0)
        int_in("gemv_max_m", gemv_max_m, 8, lo=0)
        bool_or_none("gemv_long_k", gemv_long_k, "False")
        choice("lora_end_wait", lora_end_wait, ("one", "all"))
        check_budget(kv_budget_gib, kv_budget_fraction)
        self.backend, self.use_cuda_graph = backend, use_cuda_graph
        self.check_every, self.cache_multiple = max(1, int(check_every)), max(1, int(cache_multiple))
        self.kv_budget_gib, self.kv_budget_fraction = kv_budget_gib, kv_budget_fraction
        self.lora_overlap, self.keep_state, self.single_copy = lora_overlap, keep_state, single_copy
        self.attention_splits, self.lora_kernel, self.fused_lora_max_rows, self.humming_layout = (
            attention_splits, lora_kernel, fused_lora_max_rows, humming_layout)
        self.pdl, self.lora_sms, self.lora_end_wait = pdl, lora_sms, lora_end_wait
        self.gemv_max_m, self.gemv_long_k = gemv_max_m, bool(gemv_long_k)
        self._parking = HostParking()
        self._streams: dict[tuple[torch.device, str], torch.cuda.Stream] = {}
        self._plan: Plan | None = None
        self._gemms: dict[int, GroupGemm] | None = None
        self._gemm_backend: str | None = None
        self._state: State | None = None
        self.last_stats: dict = {}
        self.max_decode_steps: int | None = None  # benchmark warm-ups: stop early

    # -- plan ---------------------------------------------------------------------------------

    def _backend_for(self, plan: Plan) -> str:
        if self.backend != "auto":
            return self.backend
        cuda_half = plan.device.type == "cuda" and plan.dtype in (torch.bfloat16, torch.float16)
        return "triton" if cuda_half and HAS_TRITON else "torch"

    def _get_plan(self, model: nn.Module) -> Plan:
        """The cached plan if nothing it references changed (same tensors, same adapters)."""
        new = build_plan(model)
        old = self._plan
        if old is not None and old.model_id == new.model_id and old.signature == new.signature \
                and old.adapters == new.adapters:
            return old
        self._plan, self._gemms, self._state = new, None, None  # graphs point into the old plan
        return new

    def _get_gemms(self, plan: Plan) -> dict[int, GroupGemm] | None:
        if plan.device.type != "cuda":
            return None
        fp4 = resolve_backend()
        if self._gemms is None or self._gemm_backend != fp4:
            self._gemms, self._state = None, None
            gemms = {}
            for g in plan.groups():  # one group at a time, so single_copy never holds both copies
                gm = gemms[id(g)] = GroupGemm(g, fp4, plan.dtype, humming_only=self.single_copy,
                                              layout=self.humming_layout,
                                              gemv_max_m=self.gemv_max_m,
                                              gemv_long_k=self.gemv_long_k)
                if self.single_copy and gm.humming is not None:
                    park_group(self._parking, g)
            self._gemms = gemms
            self._gemm_backend = fp4
        return self._gemms

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
            if not self.keep_state or self._parking.parked:
                self.release()
            if self._parking.parked:  # humming's copies go first, then the trainer's come back
                self._plan, self._gemms = None, None
                self._parking.restore()

    def release(self) -> None:
        """Free the KV cache, sampling buffers and captured graph (the next call rebuilds them)."""
        self._state = None

    def wave_rows(self, plan: Plan, n_rows: int, slots: int, group: int) -> int:
        """Rows per wave (:func:`qerl.rollout.fast.state.wave_rows`, this engine's budget)."""
        held = 0 if self._state is None else self._state.nbytes()
        return state.wave_rows(plan, n_rows, slots, group, self.kv_budget_gib,
                               self.kv_budget_fraction, held)

    def _generate(self, model, prompt_ids, sp: SamplingParams, generator) -> RolloutBatch:
        t0 = time.perf_counter()
        plan = self._get_plan(model)
        backend = self._backend_for(plan)
        pdl = resolve_pdl(self.pdl, plan.device) and backend == "triton"
        gemms = self._get_gemms(plan)
        refresh_lora(plan)
        n, n_prompts = sp.n, len(prompt_ids)
        N, T = n_prompts * n, sp.max_new_tokens
        P = max(len(p) for p in prompt_ids)
        cap = -(-(P + T) // self.cache_multiple) * self.cache_multiple
        mode = "greedy" if sp.greedy else ("full" if sp.top_p >= 1.0 else "top_p")
        if len(sp.eos_token_ids) > 8:
            raise ValueError("fast engine: at most 8 EOS ids are supported")
        dev = plan.device
        u = state.uniforms(generator, T, n, N, dev)
        W = self.wave_rows(plan, N, cap, n)
        st = self._get_state(plan, W, cap, T, mode, backend, pdl)
        if gemms:  # compile the humming kernels of this call's row counts in parallel
            precompile_groups(gemms, (W, -(-W // n) * P), decode_pdl=st.pdl, decode_sms=st.gemm_sms)
        ctx = TorchContext(gemms=gemms)
        rows_prompt = [i // n for i in range(N)]
        parts, stats = [], {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0}
        for lo in range(0, N, W):
            idx = list(range(lo, min(lo + W, N)))
            idx += [idx[-1]] * (W - len(idx))  # pad the last wave (outputs dropped)
            out = self._run_wave(plan, st, ctx, backend, [prompt_ids[rows_prompt[i]] for i in idx],
                                 u[:, idx], P, T, sp, stats)
            keep = min(W, N - lo)
            parts.append(tuple(t[:keep] for t in out))
        width = max(p[0].shape[1] for p in parts)
        cat = [torch.cat([pad_cols(p[j], width, v) for p in parts])
               for j, v in enumerate((sp.pad_token_id, 0.0, 0.0, 0.0))]
        done = torch.cat([p[4] for p in parts])
        if not sp.eos_token_ids:
            done.zero_()
        gms = list((gemms or {}).values())
        humming = sum(gm.humming is not None for gm in gms)
        layouts = sorted({gm.humming.layout for gm in gms if gm.humming is not None})
        self.last_stats = {"backend": backend, "fp4_backend": self._gemm_backend,
                           "humming_groups": humming, "humming_layouts": layouts,
                           "parked_gib": self._parking.nbytes() / GiB, "rows": N,
                           "prompt_len": P, "waves": len(parts), "wave_rows": W, **stats,
                           "total_s": time.perf_counter() - t0, "cuda_graph": st.graph is not None,
                           "lora_kernel": "fused" if st.lora_fused is not None
                           else ("cublas" if st.lora_out else "none"),
                           "lora_stream": "side" if st.side is not None else "main",
                           "pdl": st.pdl, "gemm_sms": st.gemm_sms,
                           "gemv_groups": sum(gm.uses_gemv(W) for gm in gms),
                           "lora_in_gemv": sum(st.lora_in_gemv and gm.lora_in_gemv(W) for gm in gms)}
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompt_ids for _ in range(n)],
            completion_ids=cat[0], completion_mask=cat[1], logprobs=cat[2], truncated=~done,
            prompt_index=torch.arange(n_prompts).repeat_interleave(n),
            extras={"entropy": cat[3], "engine_stats": dict(self.last_stats)})

    # -- one wave -----------------------------------------------------------------------------

    def _run_wave(self, plan: Plan, st: State, ctx: TorchContext, backend: str,
                  prompts: list[list[int]], u: torch.Tensor, P: int, T: int,
                  sp: SamplingParams, stats: dict) -> tuple[torch.Tensor, ...]:
        """Prefill and decode ``st.n_rows`` rows; returns CPU (tokens, mask, logprobs, entropy,
        done) of width ``used`` (the last step any row was live)."""
        dev = plan.device
        runs: list[list[int]] = []  # consecutive rows with the same prompt share one prefill
        for p in prompts:
            if runs and runs[-1][0] is p:
                runs[-1][1] += 1
            else:
                runs.append([p, 1])
        ids = torch.full((len(runs), P), sp.pad_token_id, dtype=torch.long)
        for i, (p, _) in enumerate(runs):
            ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        counts = torch.tensor([c for _, c in runs], device=dev)
        pad_u = torch.tensor([P - len(p) for p, _ in runs], dtype=torch.long, device=dev)
        reset_outputs(st, sp, u, pad_u.repeat_interleave(counts))
        sync(dev)
        tp0 = time.perf_counter()
        logits = self._prefill(plan, st, ctx, ids.to(dev), pad_u, counts)
        tok, lp, ent = sample_tokens(logits, st.u[0], st.temp, st.top_p, st.mode)
        st.out_tok[:, 0], st.out_lp[:, 0], st.out_ent[:, 0] = tok, lp, ent
        st.out_mask[:, 0] = 1.0
        st.done.copy_((tok.unsqueeze(-1) == st.eos.unsqueeze(0)).any(-1))
        st.tok.copy_(tok)
        st.slot.fill_(P)
        st.step.fill_(1)
        sync(dev)
        tp1 = time.perf_counter()
        steps = 0
        if T > 1 and not bool(st.done.all()):
            if backend == "triton":
                steps = self._decode_graph(plan, st, ctx, T)
            else:
                steps = self._decode_torch(plan, st, ctx, T, P)
        sync(dev)
        stats["prefill_s"] += tp1 - tp0
        stats["decode_s"] += time.perf_counter() - tp1
        stats["decode_steps"] += steps
        mask = st.out_mask[:, :T]
        used = int(mask.any(0).nonzero().max().item()) + 1 if bool(mask.any()) else 1
        m = mask[:, :used]
        outs = (st.out_tok[:, :used], m, st.out_lp[:, :used] * m, st.out_ent[:, :used] * m,
                st.done)
        return tuple(t.to("cpu", copy=True) for t in outs)  # the state is reused by next wave

    def _prefill(self, plan: Plan, st: State, ctx: TorchContext, ids: torch.Tensor,
                 pad: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Prefill the unique prompts; their KV rows are replicated ``counts`` times."""
        P = ids.shape[1]
        if bool((counts == 1).all()):
            return forward_tokens(plan, ctx, ids, 0, pad, st.k, st.v)
        shape = (ids.shape[0], plan.n_kv, P, plan.head_dim)
        kc = [torch.empty(shape, dtype=plan.dtype, device=plan.device) for _ in plan.layers]
        vc = [torch.empty(shape, dtype=plan.dtype, device=plan.device) for _ in plan.layers]
        logits = forward_tokens(plan, ctx, ids, 0, pad, kc, vc)
        rep = torch.repeat_interleave(torch.arange(ids.shape[0], device=plan.device), counts)
        for dst, src in zip(st.k + st.v, kc + vc, strict=True):
            dst[:, :, :P] = src[rep]
        return logits[rep]

    # -- state --------------------------------------------------------------------------------

    def _get_state(self, plan: Plan, rows: int, cap: int, T: int, mode: str,
                   backend: str, pdl: bool) -> State:
        st = self._state
        key = (plan.signature, backend, self._gemm_backend, self.attention_splits, self.lora_kernel,
               pdl, self.lora_sms, self.lora_end_wait)
        if st is not None and st.n_rows == rows and st.cap >= cap and st.t_cap == T \
                and st.mode == mode and st.key == key:
            return st
        self._state = None
        if plan.device.type == "cuda":
            torch.cuda.empty_cache()
        fused = (self.lora_kernel != "cublas" and backend == "triton"
                 and rows <= self.fused_lora_max_rows
                 and any(g.r_total for g in plan.groups()) and fused_lora_ok(plan.device, plan.dtype))
        st = new_state(plan, key, rows, cap, T, mode, None, self.attention_splits, fused)
        overlap = self.lora_overlap  # default: a side stream for the cuBLAS pair only
        overlap = st.lora_fused is None and bool(st.lora_out) if overlap is None else overlap
        st.side = self._stream(plan.device, "lora") if overlap else None
        st.pdl = pdl
        st.gemm_sms = beside_gemm_sms(st, self.lora_sms, plan.device)  # reads st.pdl
        st.lora_end_wait, st.lora_in_gemv = self.lora_end_wait, self.lora_kernel == "gemv"
        self._state = st
        return st

    def _stream(self, dev: torch.device, role: str) -> torch.cuda.Stream | None:
        """This engine's one stream for ``role`` on ``dev`` (CUDA; else ``None``): cuBLAS keeps a
        workspace for every stream it has run on, for the life of the process."""
        if dev.type != "cuda":
            return None
        if (dev, role) not in self._streams:
            self._streams[dev, role] = torch.cuda.Stream(dev)
        return self._streams[dev, role]

    # -- decode -------------------------------------------------------------------------------

    def _decode_torch(self, plan: Plan, st: State, ctx: TorchContext, T: int, P: int) -> int:
        steps, pad = 0, st.pad.long()
        for t in range(1, T):
            logits = forward_tokens(plan, ctx, st.tok.unsqueeze(1), P + t - 1, pad, st.k, st.v)
            u = st.u.index_select(0, st.step).squeeze(0)
            record(st, *sample_tokens(logits, u, st.temp, st.top_p, st.mode))
            st.slot.add_(1)
            st.step.add_(1)
            steps += 1
            if t % self.check_every == 0 and bool(st.done.all()):
                break
        return steps

    def _decode_graph(self, plan: Plan, st: State, ctx: TorchContext, T: int) -> int:
        if self.use_cuda_graph and plan.device.type == "cuda" and st.graph is None:
            decode.capture(plan, st, ctx, self._stream(plan.device, "warm-up"))
        steps = 0
        for t in range(1, T):
            if self.max_decode_steps is not None and steps >= self.max_decode_steps:
                break
            if st.graph is not None:
                st.graph.replay()
            else:
                decode.step(plan, st, ctx)
            steps += 1
            if t % self.check_every == 0 and bool(st.done.all()):
                break
        return steps


#: alias (the issue calls it the fast rollout engine)
FastRolloutEngine = FastEngine
