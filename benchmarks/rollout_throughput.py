"""Rollout throughput on one GPU: transformers ``generate`` vs our fast engine, per weight format.

Random-initialised Qwen2.5 architectures (real sizes, built directly on the GPU; no downloads),
prompts of 128 random tokens, sampling T=1.0 top-p 0.95 (``--top-p``), a fixed number of new tokens (no EOS),
LoRA r=32 (alpha 64) on all linear layers for the ``_lora`` columns.

Rows: ``7b-64`` (B=64, N=256), ``7b-1`` (B=1, N=256; the paper measures rollouts at batch 1),
``7b-1-2k`` (B=1, N=2048: long contexts, where the decode attention splits the KV slots),
``32b-32`` (B=32, N=128), ``7b-256`` (B=256, N=128), ``1.5b-64`` (B=64, N=256). Columns:
``hf_bf16`` (transformers generate), ``hf_nf4`` (bitsandbytes), ``fast_bf16`` (our engine, cuBLAS),
``fast_nvfp4`` / ``fast_mxfp4`` (our engine, 4-bit GEMMs by the backend ``qerl.kernels`` resolves
to: humming when installed), ``fast_nvfp4_lora`` / ``fast_mxfp4_lora``, and
``fast_nvfp4_lora_seq`` (LoRA on the main stream, ``lora_overlap=False``), ``fast_nvfp4_lora_side``
(LoRA on a side stream, ``lora_overlap=True``; by default only the cuBLAS pair takes one), ``fast_nvfp4_lora_cublas`` (LoRA as
two cuBLAS GEMMs a group instead of the fused kernel), ``fast_nvfp4_lora_ingemv`` (at one row
the LoRA inside our FP4 GEMV's launch, not the fused kernel beside it, ``lora_kernel="gemv"``),
``fast_nvfp4_lora_gemvdown`` (the down projection through our GEMV too, K split over CTAs,
``gemv_long_k=True``), ``fast_nvfp4_lora_fused64`` (the fused
LoRA kernel at every batch up to 64 rows, ``FastEngine(fused_lora_max_rows=64)``: the default since
run 27, so the same as ``fast_nvfp4_lora``),
``fast_nvfp4_ct`` / ``fast_nvfp4_lora_ct`` (humming's copy of the NVFP4 weights in the stored
compressed-tensors layout, ``FastEngine(humming_layout="ct")``; the other columns run the engine's
default, bf16 group scales), ``fast_bf16_nopdl`` / ``fast_nvfp4_nopdl`` / ``fast_nvfp4_lora_nopdl``
(the decode kernels without programmatic dependent launch, ``FastEngine(pdl=False)``; the other
columns run the engine's default, PDL where the GPU has it), ``fast_nvfp4_lora_before`` (the
fused LoRA before humming's GEMM, ``FastEngine(lora_sms=0)``), ``fast_nvfp4_lora_beside4`` /
``_beside8`` / ``_beside12`` / ``_beside16`` (beside the GEMM, which leaves it 4 / 8 / 12 / 16
multiprocessors, ``lora_sms=4`` / ... / ``16``;
8 is the engine's default, so ``_beside8`` is ``fast_nvfp4_lora``), ``fast_nvfp4_lora_onewait`` /
``_allwait`` (beside the GEMM, one LoRA program waiting for it at its end, or all of them,
``lora_end_wait="one"`` / ``"all"``; "one" is the default since run 40),
``fast_nvfp4_lora_split1`` / ``_split2`` / ``_split4`` / ``_split6`` (the decode attention's KV
slots in that many splits, ``FastEngine(attention_splits=...)``; the default chooses),
``fast_nvfp4_gemv`` /
``fast_nvfp4_lora_gemv`` (decode waves of up to 8 rows through our FP4 GEMV instead of humming,
``FastEngine(gemv_max_m=8)``; the default is 1 row), ``fast_nvfp4_humming`` /
``fast_nvfp4_lora_humming`` (humming at every row count, ``FastEngine(gemv_max_m=0)``). Per cell: tokens/s
(B*N over prefill + decode), ms per decode step, peak GiB (the variant's weights + the run's peak
extra allocation), and the floor of a decode step -- bytes that must move (weights in their
format, LoRA, LM head, the KV cache at the mean context, logits) over the measured copy
bandwidth, and FLOPs over the measured bf16 matmul rate -- with the ratio of the measured step to
it. ``--profile`` adds, per fast column, the device time of each kernel family in 5 eager decode
steps (torch.profiler).

    python benchmarks/rollout_throughput.py --rows 7b-64,7b-1,32b-32 --json out.json

One model variant is resident at a time: bf16 -> (quantized in place) nvfp4 -> nvfp4 + LoRA ->
mxfp4 (re-quantized layer by layer) -> mxfp4 + LoRA -> nf4 (likewise).
"""

# ruff: noqa: B023, B007  (closures are called inside the loop iteration that made them)
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from qerl.rollout.base import SamplingParams  # noqa: E402
from qerl.rollout.fast import FastEngine  # noqa: E402

ARCH = {
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                 tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
               tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                tie_word_embeddings=False),
}
ROWS = {"1.5b-64": ("1.5b", 64, 256), "7b-64": ("7b", 64, 256), "7b-1": ("7b", 1, 256),
        "7b-1-2k": ("7b", 1, 2048), "7b-8": ("7b", 8, 256),
        "7b-256": ("7b", 256, 128), "32b-32": ("32b", 32, 128)}
COLUMNS = ["hf_bf16", "fast_bf16", "fast_nvfp4", "fast_nvfp4_lora", "fast_mxfp4",
           "fast_mxfp4_lora"]
# the NVFP4 + LoRA variant columns: the engine options each runs with (see the module docstring)
NVFP4_LORA_VARIANTS = {"fast_nvfp4_lora_seq": dict(lora_overlap=False),
                       "fast_nvfp4_lora_side": dict(lora_overlap=True),
                       "fast_nvfp4_lora_cublas": dict(lora_kernel="cublas"),
                       "fast_nvfp4_lora_ingemv": dict(lora_kernel="gemv"),
                       "fast_nvfp4_lora_gemvdown": dict(gemv_long_k=True),
                       "fast_nvfp4_lora_fused64": dict(fused_lora_max_rows=64),
                       "fast_nvfp4_lora_ct": dict(humming_layout="ct"),
                       "fast_nvfp4_lora_nopdl": dict(pdl=False),
                       "fast_nvfp4_lora_before": dict(lora_sms=0),
                       "fast_nvfp4_lora_beside4": dict(lora_sms=4),
                       "fast_nvfp4_lora_beside8": dict(lora_sms=8),
                       "fast_nvfp4_lora_beside12": dict(lora_sms=12),
                       "fast_nvfp4_lora_beside16": dict(lora_sms=16),
                       "fast_nvfp4_lora_onewait": dict(lora_end_wait="one"),
                       "fast_nvfp4_lora_allwait": dict(lora_end_wait="all"),
                       "fast_nvfp4_lora_split2": dict(attention_splits=2),
                       "fast_nvfp4_lora_split4": dict(attention_splits=4),
                       "fast_nvfp4_lora_split6": dict(attention_splits=6),
                       "fast_nvfp4_lora_split1": dict(attention_splits=1),
                       "fast_nvfp4_lora_gemv": dict(gemv_max_m=8),
                       "fast_nvfp4_lora_humming": dict(gemv_max_m=0)}
EXTRA_COLUMNS = ["hf_nf4", "fast_nvfp4_ct", "fast_bf16_nopdl", "fast_nvfp4_nopdl", "fast_nvfp4_gemv",
                 "fast_nvfp4_humming", *NVFP4_LORA_VARIANTS]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = 128
TOP_P = 0.95  # --top-p (1.0: the pipeline's default, sampling without a nucleus)
GiB = 1 << 30


def build_model(arch: str):
    """A random bf16 Qwen2 of the given size, allocated directly on the GPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    cfg = Qwen2Config(**ARCH[arch], max_position_embeddings=32768, rope_theta=1e6,
                      rms_norm_eps=1e-6, use_sliding_window=False, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 1:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.model.rotary_emb = Qwen2RotaryEmbedding(config=cfg, device="cuda")
    model.config.use_cache = True
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    model.generation_config.bos_token_id = None
    return model.eval()


def _linears(model):
    from torch import nn

    for name, mod in model.named_modules():
        if name.endswith(tuple(TARGETS)) and "lora" not in name:
            yield name, mod
    del nn


def requantize_(model, to: str) -> None:
    """Replace every QuantLinear by the same weight in another format (layer by layer)."""
    from qerl.quant.linear import QuantLinear, set_submodule

    for name, mod in list(_linears(model)):
        w = mod.dequantize(torch.bfloat16)
        b = mod.bias
        if to == "nf4":
            import bitsandbytes as bnb

            new = bnb.nn.Linear4bit(mod.in_features, mod.out_features, bias=b is not None,
                                    compute_dtype=torch.bfloat16, quant_type="nf4",
                                    compress_statistics=False, device="cuda")
            new.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4",
                                           compress_statistics=False).to("cuda")
            if b is not None:
                new.bias = torch.nn.Parameter(b.detach().to(torch.bfloat16), requires_grad=False)
        else:
            new = QuantLinear.from_weight(w, b, to)
        set_submodule(model, name, new)
        del w, mod
    torch.cuda.empty_cache()


def model_bytes(model) -> int:
    seen, n = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        n += t.numel() * t.element_size()
    return n


def weight_stream_bytes(model, arch: str, B: int, ctx: float, lora_r: int) -> tuple[int, int]:
    """(bytes, flops) that one decode step must move / do at the given mean context."""
    a = ARCH[arch]
    H, V, L = a["hidden_size"], a["vocab_size"], a["num_hidden_layers"]
    D = H // a["num_attention_heads"]
    bytes_, params = 0, 0
    for _, mod in _linears(model):
        base = getattr(mod, "base_layer", mod)
        if hasattr(base, "weight_packed"):
            bytes_ += sum(t.numel() * t.element_size() for t in
                          (base.weight_packed, base.weight_scale))
        elif type(base).__name__ == "Linear4bit":
            bytes_ += base.weight.numel() * base.weight.element_size()
            qs = getattr(base.weight, "quant_state", None)
            if qs is not None and getattr(qs, "absmax", None) is not None:
                bytes_ += qs.absmax.numel() * qs.absmax.element_size()
        else:
            bytes_ += base.weight.numel() * base.weight.element_size()
        params += base.in_features * base.out_features
        if lora_r:
            bytes_ += (base.in_features + base.out_features) * lora_r * 2
            params += (base.in_features + base.out_features) * lora_r
    bytes_ += V * H * 2  # lm head
    kv = B * ctx * L * 2 * a["num_key_value_heads"] * D * 2
    bytes_ += int(kv) + B * V * 2 * 2
    flops = 2 * B * (params + V * H) + 4 * B * L * a["num_attention_heads"] * D * ctx
    return bytes_, int(flops)


def prompts(B: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (B, PROMPT), generator=g).tolist()


def _timed(fn, warm_fn) -> tuple[dict, int]:
    """Run ``warm_fn`` then ``fn``; return fn's result and the peak extra allocation of both."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    warm_fn()
    res = fn()
    torch.cuda.synchronize()
    return res, torch.cuda.max_memory_allocated() - base


def run_hf(model, B: int, N: int, vocab: int) -> dict:
    ids = torch.tensor(prompts(B, vocab), device="cuda")
    att = torch.ones_like(ids)
    kw = dict(do_sample=True, temperature=1.0, top_p=TOP_P, top_k=0, max_new_tokens=N,
              min_new_tokens=N, pad_token_id=0)

    def warm():
        model.generate(input_ids=ids[:, :16], attention_mask=att[:, :16],
                       **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})

    def run():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=att, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        new = out.shape[1] - ids.shape[1]
        return {"tok_s": B * new / dt, "ms_step": dt / new * 1e3, "total_s": dt, "new_tokens": new}

    res, extra = _timed(run, warm)
    res["extra_peak"] = extra
    return res


ENGINE_KW: dict = {}  # engine options every fast column gets (--attention-splits)


def run_fast(model, B: int, N: int, vocab: int, **engine_kw) -> dict:
    eng = FastEngine(keep_state=True, **{**ENGINE_KW, **engine_kw})  # warm-up's graph reused
    sp = SamplingParams(n=1, temperature=1.0, top_p=TOP_P, max_new_tokens=N, eos_token_ids=(),
                        pad_token_id=0)
    ps = prompts(B, vocab)
    info = {}

    def warm():  # compiles the kernels and captures the graph (same shapes as the timed run)
        t0 = time.perf_counter()
        eng.max_decode_steps = 8
        eng.generate(model, ps, sp, generator=torch.Generator().manual_seed(1))
        eng.max_decode_steps = None
        info["warmup_s"] = time.perf_counter() - t0

    def run():
        out = eng.generate(model, ps, sp, generator=torch.Generator().manual_seed(2))
        info["out"] = out
        st = eng.last_stats
        n_new = int(out.completion_mask.sum(1).max())
        total = st["prefill_s"] + st["decode_s"]
        return {"tok_s": B * n_new / total,
                "ms_step": st["decode_s"] / max(1, st["decode_steps"]) * 1e3,
                "prefill_ms": st["prefill_s"] * 1e3, "total_s": total, "new_tokens": n_new,
                "cuda_graph": st["cuda_graph"], "backend": st["backend"],
                "fp4_backend": st.get("fp4_backend"), "lora_kernel": st.get("lora_kernel"),
                "gemv_groups": st.get("gemv_groups"), "lora_in_gemv": st.get("lora_in_gemv")}

    res, extra = _timed(run, warm)
    out = info.pop("out")
    res.update(info)
    res["extra_peak"] = extra
    if CHECK:
        res["check_mean_abs_dlogprob"] = teacher_forced_gap(model, ps, out)
    if PROFILE:
        res["profile_us_per_step"] = profile_decode(eng)
    eng = None
    gc.collect()
    torch.cuda.empty_cache()
    return res


CHECK = False
PROFILE = False
FAMILIES = [("humming", "humming"), ("fp4_gemv", "fp4 GEMV"), ("lora_kernel", "fused LoRA"),
            ("add_rmsnorm", "add+rmsnorm"), ("attn_kernel", "attention"),
            ("silu_mul", "silu-mul"), ("fp4_dequant", "fp4 dequant"),
            ("gemm", "cuBLAS"), ("gemv", "cuBLAS"), ("xmma", "cuBLAS"), ("cutlass", "cuBLAS"),
            ("nvjet", "cuBLAS")]


def profile_decode(eng, steps: int = 5) -> dict:
    """Device microseconds per decode step by kernel family (eager steps on the engine's state)."""
    from torch.profiler import ProfilerActivity, profile

    from qerl.rollout.fast import decode
    from qerl.rollout.fast.torch_forward import TorchContext

    st, plan = eng._state, eng._plan
    ctx = TorchContext(gemms=eng._gemms)
    saved = st.snapshot()
    st.slot.sub_(steps + 1)  # the timed run left the state at the end of the cache and of the
    st.step.sub_(steps + 1)  # uniforms: rewind, or the extra steps would write past both
    decode.step(plan, st, ctx)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decode.step(plan, st, ctx)
        torch.cuda.synchronize()
    st.restore(saved)
    fam: dict = {}
    other: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
        if not us or ev.key.startswith(("cudaLaunch", "cudaStream", "cudaEvent")):
            continue
        name = next((label for key, label in FAMILIES if key in ev.key.lower()), "other")
        fam[name] = fam.get(name, 0.0) + us / steps
        if name == "other":
            other[ev.key[:80]] = other.get(ev.key[:80], 0.0) + us / steps
    fam["total"] = sum(fam.values())
    top = sorted(other.items(), key=lambda kv: -kv[1])[:8]
    fam["other_top"] = dict(top)
    print("    other (us/step): " + "; ".join(f"{k} {v:.0f}" for k, v in top), flush=True)
    print("    profile (us/step): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                 sorted(((k, v) for k, v in fam.items()
                                                         if k != "other_top"),
                                                        key=lambda kv: -kv[1])),
          flush=True)
    return fam


@torch.no_grad()
def teacher_forced_gap(model, ps, out, rows: int = 4) -> float:
    """Mean |engine log-prob - log-prob from one transformers forward pass| over ``rows`` rows."""
    ids = torch.tensor([ps[i] + out.completion_ids[i].tolist() for i in range(rows)], device="cuda")
    logits = model(input_ids=ids).logits.float()
    P = len(ps[0])
    T = out.completion_ids.shape[1]
    lp = torch.log_softmax(logits[:, P - 1:P - 1 + T], dim=-1)
    ref = lp.gather(-1, out.completion_ids[:rows].to("cuda").unsqueeze(-1)).squeeze(-1).cpu()
    gap = float((ref - out.logprobs[:rows]).abs().mean())
    print(f"    teacher-forced check: mean |d logprob| = {gap:.4f} over {rows} rows x {T} tokens",
          flush=True)
    return gap


def with_lora(model, row, B, N, V, record, cols, fmt):
    """Run the LoRA columns of ``fmt`` on ``model`` wrapped with peft; return the bare model."""
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(r=32, lora_alpha=64, target_modules=TARGETS,
                                          init_lora_weights=False))
    pm.eval()
    if f"fast_{fmt}_lora" in cols:
        record(f"fast_{fmt}_lora", lambda: run_fast(pm, B, N, V), pm, lora_r=32)
    for col, kw in NVFP4_LORA_VARIANTS.items():
        if fmt == "nvfp4" and col in cols:
            record(col, lambda: run_fast(pm, B, N, V, **kw), pm, lora_r=32)
    model = pm.unload()
    gc.collect()
    torch.cuda.empty_cache()
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="7b-64,7b-1,32b-32")
    ap.add_argument("--columns", default=",".join(COLUMNS))
    ap.add_argument("--json", default="rollout_throughput.json")
    ap.add_argument("--new-tokens", type=int, default=None, help="override N (smoke runs)")
    ap.add_argument("--hf-rows", default=None, help="rows that run the hf_* columns (default all)")
    ap.add_argument("--check", action="store_true",
                    help="compare the engine's log-probs with a transformers forward pass")
    ap.add_argument("--profile", action="store_true", help="kernel-family time per decode step")
    ap.add_argument("--attention-splits", type=int, default=None,
                    help="FastEngine(attention_splits=...) for every fast column (default: automatic)")
    ap.add_argument("--top-p", type=float, default=0.95, help="nucleus of every column (1.0: none)")
    args = ap.parse_args()
    rows, cols = args.rows.split(","), args.columns.split(",")
    unknown = [f"unknown --{flag} {', '.join(bad)} (known: {', '.join(known)})"
               for flag, names, known in (("rows", rows, list(ROWS)),
                                          ("columns", cols, COLUMNS + EXTRA_COLUMNS))
               if (bad := [v for v in names if v not in known])]
    if unknown:  # before anything touches the GPU
        ap.error("; ".join(unknown))
    if args.attention_splits is not None:
        ENGINE_KW["attention_splits"] = args.attention_splits
    global CHECK, PROFILE, TOP_P
    CHECK, PROFILE, TOP_P = args.check, args.profile, args.top_p
    sys.path.insert(0, os.path.dirname(__file__))
    from fp4_matmul import copy_bandwidth, matmul_rate

    hf_rows = args.hf_rows.split(",") if args.hf_rows else None
    bw, rate = copy_bandwidth(), matmul_rate()
    dev = torch.cuda.get_device_name()
    import transformers

    results = {"device": dev, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "command": "python " + " ".join(sys.argv), "copy_bw": bw, "matmul_flops": rate,
               "torch": torch.__version__, "transformers": transformers.__version__,
               "prompt_len": PROMPT, "sampling": f"T=1.0 top_p={args.top_p}", "cells": []}
    try:
        import humming

        from qerl.kernels import resolve_backend

        results["humming"] = humming.__version__
        results["fp4_backend"] = resolve_backend()
    except ImportError:
        pass
    print(f"{dev}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s, "
          f"torch {torch.__version__}, transformers {transformers.__version__}", flush=True)

    def dump():
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)

    for row in rows:
        arch, B, N = ROWS[row]
        N = args.new_tokens or N
        V = ARCH[arch]["vocab_size"]
        t0 = time.perf_counter()
        model = build_model(arch)
        print(f"[{row}] built {arch} in {time.perf_counter() - t0:.1f}s, "
              f"{model_bytes(model) / GiB:.1f} GiB", flush=True)
        run_hf_here = hf_rows is None or row in hf_rows

        def record(col, fn, mdl, lora_r=0):
            try:
                res = fn()
            except Exception as e:  # noqa: BLE001 - record and go on with the other cells
                import traceback

                traceback.print_exc()
                res = {"error": f"{type(e).__name__}: {e}"[:300]}
            ctx = PROMPT + N / 2
            nbytes, flops = weight_stream_bytes(mdl, arch, B, ctx, lora_r)
            cell = {"row": row, "arch": arch, "B": B, "N": N, "column": col, **res,
                    "floor_bytes": nbytes, "floor_flops": flops,
                    "floor_bw_ms": nbytes / bw * 1e3, "floor_flop_ms": flops / rate * 1e3}
            cell["floor_ms"] = max(cell["floor_bw_ms"], cell["floor_flop_ms"])
            if "ms_step" in res:
                cell["ratio_to_floor"] = res["ms_step"] / cell["floor_ms"]
                cell["peak_gib"] = (model_bytes(mdl) + res["extra_peak"]) / GiB
            results["cells"].append(cell)
            dump()
            if "error" in res:
                print(f"[{row}] {col}: ERROR {res['error']}", flush=True)
            else:
                print(f"[{row}] {col}: {res['tok_s']:.0f} tok/s, {res['ms_step']:.2f} ms/step, "
                      f"peak {cell['peak_gib']:.1f} GiB, floor {cell['floor_ms']:.2f} ms "
                      f"(bw {cell['floor_bw_ms']:.2f} / flop {cell['floor_flop_ms']:.2f}), "
                      f"x{cell['ratio_to_floor']:.2f} of floor"
                      + (f", prefill {res['prefill_ms']:.0f} ms, warm-up {res['warmup_s']:.1f}s"
                         if "prefill_ms" in res else ""), flush=True)

        if "hf_bf16" in cols and run_hf_here:
            record("hf_bf16", lambda: run_hf(model, B, N, V), model)
        if "fast_bf16" in cols:
            record("fast_bf16", lambda: run_fast(model, B, N, V), model)
        if "fast_bf16_nopdl" in cols:
            record("fast_bf16_nopdl", lambda: run_fast(model, B, N, V, pdl=False), model)
        if any(c.startswith(("fast_nvfp4", "fast_mxfp4")) or c == "hf_nf4" for c in cols):
            from qerl.quant.linear import quantize_model_

            t0 = time.perf_counter()
            quantize_model_(model, "nvfp4")
            torch.cuda.empty_cache()
            print(f"[{row}] nvfp4 in {time.perf_counter() - t0:.1f}s, "
                  f"{model_bytes(model) / GiB:.1f} GiB", flush=True)
        if "fast_nvfp4" in cols:
            record("fast_nvfp4", lambda: run_fast(model, B, N, V), model)
        if "fast_nvfp4_nopdl" in cols:
            record("fast_nvfp4_nopdl", lambda: run_fast(model, B, N, V, pdl=False), model)
        if "fast_nvfp4_gemv" in cols:
            record("fast_nvfp4_gemv", lambda: run_fast(model, B, N, V, gemv_max_m=8), model)
        if "fast_nvfp4_humming" in cols:
            record("fast_nvfp4_humming", lambda: run_fast(model, B, N, V, gemv_max_m=0), model)
        if "fast_nvfp4_ct" in cols:
            record("fast_nvfp4_ct", lambda: run_fast(model, B, N, V, humming_layout="ct"), model)
        if any(c.startswith("fast_nvfp4_lora") for c in cols):
            model = with_lora(model, row, B, N, V, record, cols, "nvfp4")
        if any(c.startswith("fast_mxfp4") for c in cols) or ("hf_nf4" in cols and run_hf_here):
            requantize_(model, "mxfp4")
            if "fast_mxfp4" in cols:
                record("fast_mxfp4", lambda: run_fast(model, B, N, V), model)
            if any(c.startswith("fast_mxfp4_lora") for c in cols):
                model = with_lora(model, row, B, N, V, record, cols, "mxfp4")
        if "hf_nf4" in cols and run_hf_here:
            try:
                import bitsandbytes  # noqa: F401

                requantize_(model, "nf4")
                record("hf_nf4", lambda: run_hf(model, B, N, V), model)
            except ImportError as e:
                print(f"[{row}] hf_nf4 skipped: {e}", flush=True)
        model = None
        gc.collect()
        torch.cuda.empty_cache()

    print("\n| model | B | N | column | tok/s | ms/step | peak GiB | floor ms (bw / flop) | x floor |")
    print("|---|---|---|---|---|---|---|---|---|")
    for c in results["cells"]:
        if "error" in c:
            print(f"| {c['arch']} | {c['B']} | {c['N']} | {c['column']} | error | | | | |")
            continue
        print(f"| {c['arch']} | {c['B']} | {c['N']} | {c['column']} | {c['tok_s']:.0f} | "
              f"{c['ms_step']:.2f} | {c['peak_gib']:.1f} | {c['floor_ms']:.2f} "
              f"({c['floor_bw_ms']:.2f} / {c['floor_flop_ms']:.2f}) | {c['ratio_to_floor']:.2f} |")


if __name__ == "__main__":  # pragma: no cover
    main()
