"""The fast rollout engine against transformers ``generate`` and a teacher-forced forward pass.

CPU tests run the engine's torch backend (the CPU path: no graphs, no Triton) on small random
Qwen2 / Llama models: greedy tokens must equal ``generate``'s and log-probs must match, with
prompts of different lengths in one batch, FP4 (``QuantLinear``) bases, peft LoRA adapters applied
unmerged and batched per group, AQN-style in-place noise on the norm weights, EOS handling and
the wave split. The GPU tests (skipped without CUDA) run the Triton backend with CUDA graphs and
each 4-bit backend against the same references.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from qerl.rollout.base import RolloutEngine, SamplingParams
from qerl.rollout.fast import FastEngine
from qerl.rollout.fast.pdl import pdl_supported
from qerl.rollout.hf import HFGenerateEngine

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19], [3]]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(arch: str = "qwen2", fmt: str | None = None, lora: bool = False, device="cpu",
           dtype=torch.float32, seed: int = 0, **over):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=0, eos_token_id=1, bos_token_id=1, initializer_range=0.3)
    common.update(over)
    if arch == "qwen2":
        cfg = Qwen2Config(**common, tie_word_embeddings=True)
    else:
        cfg = LlamaConfig(**common, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if fmt is not None:
        from qerl.quant.linear import quantize_model_

        quantize_model_(model, fmt)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                 init_lora_weights=False))
    return model.to(device=device, dtype=dtype).eval()


def _teacher_forced_logprobs(model, batch, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[token] of every completion token, from one full forward pass."""
    rows = [p + c.tolist() for p, c in zip(batch.prompt_ids, batch.completion_ids, strict=True)]
    width = max(len(r) for r in rows)
    dev = next(model.parameters()).device
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    att = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        att[i, width - len(r):] = 1
    pos = (att.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        logits = model(input_ids=ids.to(dev), attention_mask=att.to(dev),
                       position_ids=pos.to(dev)).logits.float().cpu()
    T = batch.completion_ids.shape[1]
    out = torch.zeros(len(rows), T)
    for i, r in enumerate(rows):
        start = width - len(r) + len(batch.prompt_ids[i])
        lp = torch.log_softmax(logits[i, start - 1:start - 1 + T] / temperature, dim=-1)
        out[i] = lp.gather(-1, batch.completion_ids[i].unsqueeze(-1)).squeeze(-1)
    return out * batch.completion_mask


def test_is_a_rollout_engine() -> None:
    assert isinstance(FastEngine(), RolloutEngine)
    assert FastEngine().name == "fast"
    with pytest.raises(ValueError):
        FastEngine(backend="nope")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_equals_hf_generate(arch: str) -> None:
    model = _model(arch)
    sp = SamplingParams(n=1, greedy=True, max_new_tokens=12, eos_token_ids=(), pad_token_id=0)
    out = FastEngine(backend="torch").generate(model, PROMPTS, sp)
    ref = HFGenerateEngine().generate(model, PROMPTS, sp)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-4, rtol=0)
    assert out.completion_mask.equal(ref.completion_mask)
    assert out.truncated.all() and out.prompt_index.tolist() == [0, 1, 2, 3]
    # the rows really differ (a degenerate model would make the comparison vacuous)
    assert len({tuple(r.tolist()) for r in out.completion_ids}) == 4


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_base_with_lora_equals_hf_generate(fmt: str) -> None:
    pytest.importorskip("peft")
    model = _model("qwen2", fmt=fmt, lora=True)
    sp = SamplingParams(n=1, greedy=True, max_new_tokens=10, eos_token_ids=(), pad_token_id=0)
    out = FastEngine(backend="torch").generate(model, PROMPTS, sp)
    ref = HFGenerateEngine().generate(model, PROMPTS, sp)
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-4, rtol=0)
    # the adapter is live: disabling it changes the rollout, and matches generate again
    with model.disable_adapter():
        base = FastEngine(backend="torch").generate(model, PROMPTS, sp)
        ref_base = HFGenerateEngine().generate(model, PROMPTS, sp)
    assert torch.equal(base.completion_ids, ref_base.completion_ids)
    assert not torch.equal(base.completion_ids, out.completion_ids)


def test_sampled_logprobs_match_teacher_forcing_and_top_p() -> None:
    model = _model("llama")
    sp = SamplingParams(n=3, temperature=0.7, top_p=0.8, max_new_tokens=8, eos_token_ids=(2,),
                        pad_token_id=0)
    eng = FastEngine(backend="torch")
    out = eng.generate(model, PROMPTS, sp, generator=torch.Generator().manual_seed(3))
    assert out.completion_ids.shape[0] == 12 and out.prompt_index.tolist() == [i // 3 for i in range(12)]
    ref = _teacher_forced_logprobs(model, out, 0.7)
    torch.testing.assert_close(out.logprobs, ref, atol=1e-4, rtol=0)
    # every sampled token lies in the nucleus of its step: mass strictly above it < top_p
    lp_all = []
    for i in range(12):
        lp_all.append(out.logprobs[i][out.completion_mask[i].bool()])
    assert all((lp <= 0).all() for lp in lp_all)
    # reproducible from the generator, and a different seed gives a different rollout
    again = eng.generate(model, PROMPTS, sp, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again.completion_ids, out.completion_ids)
    other = eng.generate(model, PROMPTS, sp, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(other.completion_ids, out.completion_ids)


def test_top_p_restricts_to_nucleus() -> None:
    from qerl.rollout.fast import sample_tokens

    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 3
    u = torch.rand(64)
    tok, lp, _ = sample_tokens(logits, u, torch.tensor([1.0]), torch.tensor([0.5]), "top_p")
    p = torch.softmax(logits, -1)
    above = (p * (p > p.gather(-1, tok[:, None]))).sum(-1)
    assert (above < 0.5).all()
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1))
    g, _, _ = sample_tokens(logits, u, torch.tensor([1.0]), torch.tensor([1.0]), "greedy")
    assert torch.equal(g, logits.argmax(-1))


def test_sampling_is_the_inverse_cdf_of_the_kept_distribution_in_vocabulary_order() -> None:
    """A grid of uniforms lands on each token as often as its renormalised probability says; the
    nucleus keeps tied logits together (the tie at its edge is kept whole, not cut by token id)."""
    from qerl.rollout.fast.sampling import nucleus_mask, sample_tokens_torch

    x = torch.tensor([[2.0, 0.0, 1.0, 1.0, -1.0, 1.0, 0.5]])
    p = torch.softmax(x, -1)
    top_p = float(p[0, 0]) + 1e-3  # the top token alone is short of it: the next mass is the 3-way tie
    keep = nucleus_mask(p, x, torch.tensor([top_p]))
    assert keep.tolist() == [[True, False, True, True, False, True, False]]
    n = 20000
    u = (torch.arange(n) + 0.5) / n
    rows = x.expand(n, -1)
    for mode, kept in (("full", torch.ones(7, dtype=torch.bool)), ("top_p", keep[0])):
        tok, lp, _ = sample_tokens_torch(rows, u, torch.tensor([1.0]), torch.tensor([top_p]), mode)
        want = p[0] * kept / (p[0] * kept).sum()
        counts = torch.bincount(tok, minlength=7)
        assert (counts - want * n).abs().max() <= 1, (mode, counts)
        assert torch.all(tok[1:] >= tok[:-1])  # vocabulary order: increasing u, increasing id
        torch.testing.assert_close(lp, torch.log_softmax(x, -1)[0, tok])  # not renormalised


def test_sampling_kernel_is_used_only_after_it_agrees_with_the_torch_reference(monkeypatch) -> None:
    from qerl.rollout.fast import sampling

    cpu = torch.device("cpu")
    monkeypatch.setattr(sampling, "_KERNEL_OK", {})
    monkeypatch.setattr(sampling, "sample_kernel", lambda x, u, t, p, mode: (x.argmin(-1),) + sampling.sample_tokens_torch(x, u, t, p, mode)[1:])
    with pytest.warns(UserWarning, match="sampling kernel failed its check"):
        assert not sampling._kernel_ok(cpu)
    assert not sampling._kernel_ok(cpu)  # decided once a device and dtype: no second warning
    monkeypatch.setattr(sampling, "_KERNEL_OK", {})
    monkeypatch.setattr(sampling, "sample_kernel", sampling.sample_tokens_torch)
    assert sampling._kernel_ok(cpu) and sampling._kernel_ok(cpu, torch.float16)
    assert set(sampling._KERNEL_OK) == {(cpu, torch.bfloat16), (cpu, torch.float16)}


def test_engine_releases_its_kv_cache_unless_asked_to_keep_it() -> None:
    model = _model("qwen2")
    sp = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, eos_token_ids=(), pad_token_id=0)
    eng = FastEngine()
    eng.generate(model, PROMPTS, sp, generator=torch.Generator().manual_seed(0))
    assert eng._state is None and eng._plan is not None
    keep = FastEngine(keep_state=True)
    keep.generate(model, PROMPTS, sp, generator=torch.Generator().manual_seed(0))
    assert keep._state is not None
    keep.release()
    assert keep._state is None


def test_eos_stops_rows_like_hf() -> None:
    model = _model("qwen2", seed=1)
    sp0 = SamplingParams(n=1, greedy=True, max_new_tokens=10, eos_token_ids=(), pad_token_id=0)
    free = FastEngine(backend="torch").generate(model, PROMPTS, sp0)
    eos = int(free.completion_ids[0, 3])  # row 0 emits it at step 3 (or earlier)
    sp = SamplingParams(n=1, greedy=True, max_new_tokens=10, eos_token_ids=(eos,), pad_token_id=0)
    out = FastEngine(backend="torch").generate(model, PROMPTS, sp)
    ref = HFGenerateEngine().generate(model, PROMPTS, sp)
    assert out.completion_ids.shape == ref.completion_ids.shape
    assert torch.equal(out.completion_ids, ref.completion_ids)
    assert torch.equal(out.completion_mask, ref.completion_mask)
    assert torch.equal(out.truncated, ref.truncated)
    assert not out.truncated[0]
    row = out.completion_mask[0]
    first = int((out.completion_ids[0] == eos).nonzero()[0])
    assert row[: first + 1].all() and not row[first + 1:].any()


def test_norm_noise_in_place_is_seen() -> None:
    """AQN adds noise to the norm weights in place: the engine must read the live tensors."""
    model = _model("qwen2")
    sp = SamplingParams(n=1, greedy=True, max_new_tokens=6, eos_token_ids=(), pad_token_id=0)
    eng = FastEngine(backend="torch")
    clean = eng.generate(model, PROMPTS, sp)
    norms = [m.weight for n, m in model.named_modules() if n.endswith("layernorm")]
    saved = [w.detach().clone() for w in norms]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in norms:
            w.add_(torch.randn(w.shape, generator=gen) * 0.3)
    noisy = eng.generate(model, PROMPTS, sp)
    ref = HFGenerateEngine().generate(model, PROMPTS, sp)
    assert torch.equal(noisy.completion_ids, ref.completion_ids)
    torch.testing.assert_close(noisy.logprobs, ref.logprobs, atol=1e-4, rtol=0)
    assert not torch.allclose(noisy.logprobs, clean.logprobs)
    with torch.no_grad():
        for w, s in zip(norms, saved, strict=True):
            w.copy_(s)
    again = eng.generate(model, PROMPTS, sp)
    assert torch.equal(again.completion_ids, clean.completion_ids)


def test_rejects_empty_prompts() -> None:
    model = _model("qwen2")
    sp = SamplingParams(n=1, greedy=True, max_new_tokens=2)
    with pytest.raises(ValueError):
        FastEngine(backend="torch").generate(model, [[1], []], sp)


def test_batched_group_lora_equals_peft_modules() -> None:
    """One shrink (stacked A) and one block-diagonal expand per group == peft's per-projection sum,
    with a different rank per projection."""
    from peft import LoraConfig, get_peft_model

    from qerl.rollout.fast.plan import build_plan, refresh_lora
    from qerl.rollout.fast.torch_forward import TorchContext, group_forward

    base = _model("qwen2", fmt="nvfp4")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                            rank_pattern={"k_proj": 2, "gate_proj": 6},
                                            init_lora_weights=False)).eval()
    plan = build_plan(model)
    refresh_lora(plan)
    layer = model.base_model.model.model.layers[1]
    at, mlp = layer.self_attn, layer.mlp
    lay = plan.layers[1]
    assert lay.qkv.r_total == 4 + 2 + 4 and lay.gu.r_total == 6 + 4
    x = torch.randn(3, 5, 64)
    ctx = TorchContext()
    with torch.no_grad():
        for group, mods in [(lay.qkv, [at.q_proj, at.k_proj, at.v_proj]),
                            (lay.gu, [mlp.gate_proj, mlp.up_proj]), (lay.o, [at.o_proj])]:
            for ours, ref in zip(group_forward(ctx, group, x), [m(x) for m in mods], strict=True):
                torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        # the adapter matters (a zero LoRA would make the comparison vacuous)
        with model.disable_adapter():
            plain = at.q_proj(x)
        assert not torch.allclose(plain, at.q_proj(x), atol=1e-3)


def _budget_for_rows(model, rows: float, sp: SamplingParams) -> float:
    from qerl.rollout.fast.engine import GiB
    from qerl.rollout.fast.plan import build_plan
    from qerl.rollout.fast.state import SAMPLING_BYTES_PER_LOGIT

    plan = build_plan(model)
    cap = 128  # default cache_multiple; prompts + new tokens fit in it
    per_row = plan.kv_bytes_per_row(cap) + SAMPLING_BYTES_PER_LOGIT * plan.vocab
    return rows * per_row / GiB


@pytest.mark.parametrize("budget_rows,waves,wave_rows", [(4.5, 4, 3), (2.5, 6, 2)])
def test_waves_give_the_same_rollout(budget_rows: float, waves: int, wave_rows: int) -> None:
    """A batch that does not fit the KV budget runs in waves with the same per-row results
    (whole prompt groups when one fits; prompts split across waves otherwise)."""
    model = _model("qwen2", fmt="mxfp4", lora=True)
    sp = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=8, eos_token_ids=(2,),
                        pad_token_id=0)
    one = FastEngine(backend="torch").generate(model, PROMPTS, sp,
                                               generator=torch.Generator().manual_seed(5))
    eng = FastEngine(backend="torch", kv_budget_gib=_budget_for_rows(model, budget_rows, sp))
    split = eng.generate(model, PROMPTS, sp, generator=torch.Generator().manual_seed(5))
    assert eng.last_stats["waves"] == waves and eng.last_stats["wave_rows"] == wave_rows
    assert torch.equal(split.completion_ids, one.completion_ids)
    assert torch.equal(split.completion_mask, one.completion_mask)
    assert torch.equal(split.truncated, one.truncated)
    torch.testing.assert_close(split.logprobs, one.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(split.extras["entropy"], one.extras["entropy"], rtol=0, atol=1e-5)
    assert split.prompt_index.tolist() == one.prompt_index.tolist()
    assert len({tuple(r.tolist()) for r in one.completion_ids}) > 6  # rows really differ


def test_bad_engine_options() -> None:
    with pytest.raises(ValueError, match="kv_budget_gib"):
        FastEngine(kv_budget_gib=0)
    with pytest.raises(ValueError, match="kv_budget_fraction"):
        FastEngine(kv_budget_fraction=1.5)
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="attention_splits"):
            FastEngine(attention_splits=bad)
    with pytest.raises(ValueError, match="lora_kernel must be fused, gemv or cublas"):
        FastEngine(lora_kernel="triton")
    for bad in (0, 65, True, 1.0):
        with pytest.raises(ValueError, match="fused_lora_max_rows must be an int in 1..64"):
            FastEngine(fused_lora_max_rows=bad)
    with pytest.raises(ValueError, match="humming_layout must be ct or bf16_scales"):
        FastEngine(humming_layout="e4m3")
    with pytest.raises(ValueError, match="pdl must be True, False or None"):
        FastEngine(pdl="on")
    for bad in (-1, 65, True, 8.0):
        with pytest.raises(ValueError, match="lora_sms must be an int in 0..64"):
            FastEngine(lora_sms=bad)
    with pytest.raises(ValueError, match="lora_end_wait must be one or all"):
        FastEngine(lora_end_wait="none")
    with pytest.raises(ValueError, match="gemv_long_k must be True, False or None"):
        FastEngine(gemv_long_k="down")
    assert FastEngine(gemv_long_k=None).gemv_long_k is False
    for bad in (-1, 9, True, 1.0):
        with pytest.raises(ValueError, match="gemv_max_m must be an int in 0..8"):
            FastEngine(gemv_max_m=bad)
    assert FastEngine().gemv_max_m == 1  # one-row decode waves through the FP4 GEMV by default
    # asked for where it cannot work: refused before the prefill, naming the option and the fix
    eng = FastEngine(backend="torch", pdl=True)
    with pytest.raises(ValueError, match=r"pdl=True needs a CUDA GPU .* use pdl=None"):
        eng.generate(_model("qwen2"), PROMPTS, SamplingParams(n=1, greedy=True, max_new_tokens=2))
    assert eng._state is None
    with pytest.raises(ValueError, match="EOS"):
        FastEngine(backend="torch").generate(_model("qwen2"), PROMPTS, SamplingParams(
            n=1, greedy=True, max_new_tokens=2, eos_token_ids=tuple(range(9))))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available(),
                    reason="CPU check of the Triton decode step, under TRITON_INTERPRET=1")
@pytest.mark.parametrize("fmt,splits,lora_kernel,one_row,max_rows", [
    (None, 1, "fused", True, 64), ("nvfp4", 1, "fused", True, 64), ("nvfp4", 3, "cublas", False, 64),
    ("nvfp4", 1, "fused", False, 64), ("nvfp4", 3, "fused", False, 64),
    ("nvfp4", 1, "fused", False, 1)])  # more rows than fused_lora_max_rows: the cuBLAS pair
def test_triton_decode_step_equals_torch_path_interpreted(fmt, splits, lora_kernel, one_row,
                                                          max_rows) -> None:
    pytest.importorskip("triton")
    model = _model("qwen2", fmt=fmt, lora=True)
    prompts = PROMPTS[:1] if one_row else PROMPTS
    sp = SamplingParams(n=1 if one_row else 2, temperature=1.0, top_p=0.9, max_new_tokens=6,
                        eos_token_ids=(), pad_token_id=0)
    ref = FastEngine(backend="torch").generate(model, prompts, sp,
                                               generator=torch.Generator().manual_seed(0))
    eng = FastEngine(backend="triton", attention_splits=splits, lora_kernel=lora_kernel,
                     fused_lora_max_rows=max_rows)
    out = eng.generate(model, prompts, sp, generator=torch.Generator().manual_seed(0))
    assert eng.last_stats["backend"] == "triton"
    rows = len(prompts) * sp.n
    assert eng.last_stats["lora_kernel"] == ("fused" if lora_kernel == "fused" and rows <= max_rows
                                             else "cublas")
    assert torch.equal(out.completion_ids, ref.completion_ids)
    torch.testing.assert_close(out.logprobs, ref.logprobs, rtol=0, atol=1e-4)


# ------------------------------------------------------------------------------ GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_model(fmt):
    return _model("qwen2", fmt=fmt, lora=True, device="cuda", dtype=torch.bfloat16,
                  hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, initializer_range=0.05)


@gpu
@pytest.mark.parametrize("fmt,fp4", [(None, "auto"), ("nvfp4", "humming"), ("mxfp4", "humming"),
                                     ("nvfp4", "triton"), ("mxfp4", "torch")])
def test_gpu_graph_engine_matches_teacher_forcing(fmt, fp4) -> None:
    """bf16 on the GPU: the graph-replayed Triton path agrees with a full forward pass."""
    from qerl.kernels import backend_available, use_backend

    if fp4 != "auto" and not backend_available(fp4):
        pytest.skip(f"{fp4} not available")
    previous = use_backend(fp4)
    try:
        model = _gpu_model(fmt)
        eng = FastEngine(keep_state=True)  # the second call replays the first call's graph
        sp = SamplingParams(n=2, temperature=1.0, top_p=0.95, max_new_tokens=40,
                            eos_token_ids=(), pad_token_id=0)
        out = eng.generate(model, PROMPTS, sp, generator=torch.Generator().manual_seed(0))
        assert eng.last_stats["backend"] == "triton" and eng.last_stats["cuda_graph"]
        assert eng.last_stats["pdl"] == pdl_supported(torch.device("cuda"))
        if fmt is not None and fp4 != "auto":
            assert eng.last_stats["fp4_backend"] == fp4
            # every decoder group runs as one humming GEMM (only the dense LM head does not)
            expected = 4 * model.config.num_hidden_layers if fp4 == "humming" else 0
            assert eng.last_stats["humming_groups"] == expected
            if fp4 == "humming":  # the engine's default layout (NVFP4: bf16 group scales)
                assert eng.last_stats["humming_layouts"] == (
                    ["bf16_scales"] if fmt == "nvfp4" else ["ct"])
        ref = _teacher_forced_logprobs(model, out, 1.0)
        err = (out.logprobs - ref).abs()
        assert err.mean() < 0.05 and err.max() < 0.5, (err.mean(), err.max())
        # norm weights changed in place after capture: the replayed graph sees them
        norms = [m.weight for n, m in model.named_modules() if n.endswith("layernorm")]
        with torch.no_grad():
            for w in norms:
                w.mul_(1.5)
        out2 = eng.generate(model, PROMPTS, sp, generator=torch.Generator().manual_seed(0))
        ref2 = _teacher_forced_logprobs(model, out2, 1.0)
        assert (out2.logprobs - ref2).abs().mean() < 0.05
        assert not torch.allclose(out2.logprobs, out.logprobs)
    finally:
        use_backend(previous)


@gpu
@pytest.mark.parametrize("fmt,lora,splits,n_rows,max_rows,overlap", [
    (None, False, 1, 8, 64, None), ("nvfp4", True, 1, 8, 64, None), ("nvfp4", True, 4, 8, 64, None),
    ("nvfp4", True, 1, 1, 64, None), ("nvfp4", True, 4, 1, 64, None),
    ("nvfp4", True, 1, 8, 1, None),    # more rows than fused_lora_max_rows: cuBLAS, side stream
    ("nvfp4", True, 1, 8, 64, True)])  # the fused kernel forced onto the side stream
def test_gpu_graph_captured_at_real_model_width(fmt, lora, splits, n_rows, max_rows,
                                                overlap) -> None:
    """7B widths and the 152k vocabulary (two layers): the decode step is captured as a graph
    (the top-p sampling kernels, the fused LoRA or the cuBLAS pair, the LoRA side stream's fork
    and join, split attention), and agrees with a full forward pass."""
    from qerl.rollout.fast import sampling

    model = _model("qwen2", fmt=fmt, lora=lora, device="cuda", dtype=torch.bfloat16,
                   hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064, initializer_range=0.02)
    eng = FastEngine(attention_splits=splits, fused_lora_max_rows=max_rows, lora_overlap=overlap)
    prompts = PROMPTS if n_rows == 8 else PROMPTS[:1]  # 4 prompts x 2 rows, or one row
    sp = SamplingParams(n=n_rows // len(prompts), temperature=1.0, top_p=0.95, max_new_tokens=20,
                        eos_token_ids=(), pad_token_id=0)
    out = eng.generate(model, prompts, sp, generator=torch.Generator().manual_seed(0))
    assert eng.last_stats["cuda_graph"], "decode step not captured"
    assert sampling._KERNEL_OK[torch.device("cuda", torch.cuda.current_device()), torch.bfloat16], \
        "sampling kernel fell back"
    want = "none" if not lora else ("fused" if n_rows <= max_rows else "cublas")
    assert eng.last_stats["lora_kernel"] == want
    # by default only the cuBLAS pair runs on the side stream
    side = overlap if overlap is not None else want == "cublas"
    assert eng.last_stats["lora_stream"] == ("side" if side else "main")
    err = (out.logprobs - _teacher_forced_logprobs(model, out, 1.0)).abs()
    assert err.mean() < 0.05, err.mean()


@gpu
@pytest.mark.parametrize("n_rows,lora_kernel,lora_sms,end_wait", [
    (1, "fused", 0, "all"), (8, "fused", 0, "all"), (8, "cublas", 0, "all"),
    (1, "fused", 16, "all"), (8, "fused", 16, "one"), (8, "fused", 8, "one")])
def test_gpu_pdl_rollout_matches_teacher_forcing(n_rows, lora_kernel, lora_sms, end_wait) -> None:
    """Programmatic dependent launch changes when kernels start, not what they compute: at 7B
    widths (two layers, NVFP4 + LoRA: humming, the fused LoRA's ticket protocol or the cuBLAS
    pair on its side stream, every Triton kernel) the rollout with it agrees with a full forward
    pass as closely as the one without; so does the fused LoRA run beside the GEMM
    (``lora_sms``: launched after it, waiting at its end). (Not token for token: the rollout is not bitwise
    reproducible from run to run even without PDL -- the prefill's first log-prob already
    varies, run 35 of docs/benchmarks.md -- so greedy tokens of a random model diverge.)"""
    if not pdl_supported(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch on this GPU / Triton")
    model = _model("qwen2", fmt="nvfp4", lora=True, device="cuda", dtype=torch.bfloat16,
                   hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064, initializer_range=0.02)
    prompts = PROMPTS if n_rows == 8 else PROMPTS[:1]
    sp = SamplingParams(n=n_rows // len(prompts), temperature=1.0, top_p=0.95,
                        max_new_tokens=24, eos_token_ids=(), pad_token_id=0)
    errs = {}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for pdl in (False, True):
        eng = FastEngine(pdl=pdl, lora_kernel=lora_kernel, lora_sms=lora_sms,
                         lora_end_wait=end_wait)
        out = eng.generate(model, prompts, sp, generator=torch.Generator().manual_seed(0))
        assert eng.last_stats["pdl"] is pdl and eng.last_stats["cuda_graph"]
        assert eng.last_stats["lora_kernel"] == lora_kernel
        beside = pdl and lora_sms > 0 and lora_kernel == "fused"
        assert eng.last_stats["gemm_sms"] == (sms - lora_sms if beside else None)
        errs[pdl] = (out.logprobs - _teacher_forced_logprobs(model, out, 1.0)).abs()
    assert errs[True].mean() < 0.05 and errs[True].max() < 0.5, errs[True]
    assert errs[True].mean() < 2 * errs[False].mean() + 0.01, (errs[True].mean(), errs[False].mean())


@gpu
def test_gpu_waves_match_teacher_forcing() -> None:
    model = _gpu_model("nvfp4")
    sp = SamplingParams(n=3, temperature=1.0, top_p=0.95, max_new_tokens=24, eos_token_ids=(),
                        pad_token_id=0)
    eng = FastEngine(kv_budget_gib=_budget_for_rows(model, 4.5, sp))
    out = eng.generate(model, PROMPTS, sp, generator=torch.Generator().manual_seed(1))
    assert eng.last_stats["waves"] == 4 and eng.last_stats["cuda_graph"]
    err = (out.logprobs - _teacher_forced_logprobs(model, out, 1.0)).abs()
    assert err.mean() < 0.05, err.mean()


class _FakeHumming:
    """CPU stand-in for ``HummingFp4`` with its contract: members stacked along N, NVFP4 with
    distinct global scales (or any NVFP4 in the ``bf16_scales`` layout) run with global 1 and
    report ``col_scale = 1 / global``."""

    def __init__(self, fmt, members, bias=None, dtype=torch.bfloat16, layout="ct"):
        from qerl.quant.formats import FORMATS

        gs = [m[2] for m in members]
        self.layout = layout
        distinct = fmt == "nvfp4" and (len({float(g) for g in gs}) > 1 or layout == "bf16_scales")
        ws = []
        for packed, scale, g in members:
            t = {"weight_packed": packed, "weight_scale": scale}
            if fmt == "nvfp4":
                t["weight_global_scale"] = torch.ones_like(g) if distinct else g
            ws.append(FORMATS[fmt].dequantize(t, torch.float32))
        self.w = torch.cat(ws)
        self.col_scale = torch.cat([torch.full((m[0].shape[0],), 1.0) / m[2].float()
                                    for m in members]) if distinct else None

    def __call__(self, x, pdl=False, sms=None):
        return (x.float() @ self.w.t()).to(x.dtype)


@pytest.mark.parametrize("fp4,layout", [("humming", "ct"), ("humming", "bf16_scales"),
                                         ("torch", "ct")])
def test_group_gemm_paths_equal_peft(monkeypatch: pytest.MonkeyPatch, fp4: str, layout: str) -> None:
    """The CUDA group paths' plumbing (humming: stacked GEMM, per-column scales, also for a single
    member in the ``bf16_scales`` layout; torch: all members dequantized into the shared scratch,
    one GEMM; both: group bias, batched LoRA) against peft's modules, with humming replaced by a
    CPU stand-in of its contract."""
    from peft import LoraConfig, get_peft_model

    from qerl.kernels import humming_gemm
    from qerl.rollout.fast.gemm import GroupGemm
    from qerl.rollout.fast.plan import build_plan, refresh_lora
    from qerl.rollout.fast.torch_forward import TorchContext, group_forward

    monkeypatch.setattr(humming_gemm, "HummingFp4", _FakeHumming)
    model = get_peft_model(_model("qwen2", fmt="nvfp4"), LoraConfig(
        r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)).eval()
    model.to(torch.bfloat16)
    plan = build_plan(model)
    refresh_lora(plan)
    gemms = {id(g): GroupGemm(g, fp4, torch.bfloat16, layout=layout) for g in plan.groups()}
    lay = plan.layers[0]
    assert (gemms[id(lay.qkv)].humming is not None) == (fp4 == "humming")
    assert (gemms[id(lay.qkv)].col_scale is not None) == (fp4 == "humming")
    assert (gemms[id(lay.o)].col_scale is not None) == (layout == "bf16_scales")
    if fp4 == "humming":
        assert gemms[id(lay.qkv)].humming.layout == layout
    assert gemms[id(plan.lm_head)].humming is None  # dense: not a humming group
    at = model.base_model.model.model.layers[0].self_attn
    x = torch.randn(6, 64).to(torch.bfloat16)
    with torch.no_grad():
        outs = group_forward(TorchContext(gemms=gemms), lay.qkv, x)
        outs += group_forward(TorchContext(gemms=gemms), lay.o, x)
        refs = [at.q_proj(x), at.k_proj(x), at.v_proj(x), at.o_proj(x)]
        for ours, ref in zip(outs, refs, strict=True):
            assert float((ours.float() - ref.float()).norm() / ref.float().norm()) < 1e-2


def test_host_parking_moves_storage_and_brings_it_back() -> None:
    """park(): same tensor objects, storage on the host, values kept; restore(): back on the
    original device, values equal; a second round reuses the host buffers."""
    from qerl.rollout.fast.residency import HostParking

    ts = [torch.randn(4, 6), torch.arange(10, dtype=torch.uint8), torch.randn(3).to(torch.bfloat16)]
    ref = [t.clone() for t in ts]
    ptrs = [t.data_ptr() for t in ts]
    park = HostParking()
    for _ in range(2):
        park.park(ts + [ts[0]])  # a tensor listed twice is parked once
        assert park.parked == 3 and park.nbytes() == sum(t.numel() * t.element_size() for t in ts)
        assert all(t.device.type == "cpu" for t in ts)
        assert all(t.data_ptr() != p for t, p in zip(ts, ptrs, strict=True))
        assert all(torch.equal(t, r) and t.dtype == r.dtype for t, r in zip(ts, ref, strict=True))
        host = [t.data_ptr() for t in ts]
        park.restore()
        assert park.parked == 0 and park.nbytes() == 0
        assert all(torch.equal(t, r) for t, r in zip(ts, ref, strict=True))
    park.park(ts)
    assert [t.data_ptr() for t in ts] == host  # the host buffers are reused
    park.restore()
    assert park.host_buffers == 3
    del ts
    gc.collect()
    assert park.host_buffers == 0  # dropped with their tensors


def test_park_group_parks_fp4_buffers_and_drops_the_layers_kernel_cache() -> None:
    """The engine's single-copy step for one group: its members' 4-bit buffers go to the host and
    any humming copy their QuantLinear cached for itself is dropped."""
    from qerl.rollout.fast.plan import build_plan
    from qerl.rollout.fast.residency import HostParking, park_group

    model = _model("qwen2", fmt="nvfp4", lora=True).eval()
    g = build_plan(model).layers[0].qkv
    for m in g.members:
        m.module.kernel_cache.get(("humming", torch.bfloat16), (), lambda: object())
        assert len(m.module.kernel_cache) == 1
    park = HostParking()
    park_group(park, g)
    assert park.parked == 3 * len(g.members)  # packed, scale, global scale per NVFP4 member
    assert all(len(m.module.kernel_cache) == 0 for m in g.members)
    assert all(m.module.weight_packed is m.packed for m in g.members)
    park.restore()


def test_humming_only_group_never_reads_the_parked_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``humming_only`` every row count (prefill included, above ``humming_max_m``) runs
    through humming's own copy: poisoning the parked compressed-tensors buffers changes nothing."""
    from qerl.kernels import humming_gemm
    from qerl.kernels.backend import humming_max_m
    from qerl.rollout.fast.gemm import GroupGemm
    from qerl.rollout.fast.plan import build_plan, refresh_lora
    from qerl.rollout.fast.residency import HostParking
    from qerl.rollout.fast.torch_forward import TorchContext, group_forward

    monkeypatch.setattr(humming_gemm, "HummingFp4", _FakeHumming)
    model = _model("qwen2", fmt="nvfp4", lora=True).eval().to(torch.bfloat16)
    plan = build_plan(model)
    refresh_lora(plan)
    lay = plan.layers[0]
    rows = humming_max_m() + 5
    x = torch.randn(rows, lay.gu.in_f).to(torch.bfloat16)
    with torch.no_grad():
        ref = group_forward(TorchContext(gemms={id(lay.gu): GroupGemm(lay.gu, "torch", torch.bfloat16)}),
                            lay.gu, x)
        gm = GroupGemm(lay.gu, "humming", torch.bfloat16, humming_only=True)
        assert gm.uses_humming(rows) and gm.max_scratch() == 0
        assert not GroupGemm(lay.gu, "humming", torch.bfloat16).uses_humming(rows)
        park = HostParking()
        park.park([t for m in lay.gu.members for t in m.fp4_tensors() if t is not None])
        for m in lay.gu.members:
            m.packed.fill_(0xFF)  # the parked copy: poison it
            m.scale.fill_(0x7F)
        outs = group_forward(TorchContext(gemms={id(lay.gu): gm}), lay.gu, x)
    for ours, r in zip(outs, ref, strict=True):
        assert torch.isfinite(ours).all()
        assert float((ours.float() - r.float()).norm() / r.float().norm()) < 1e-2


@gpu
def test_gpu_single_copy_keeps_one_copy_and_the_same_rollout() -> None:
    """``single_copy``: the same greedy rollout; during it the trainer's 4-bit buffers are parked,
    afterwards they are back on the GPU and humming's copies are gone (memory back to baseline)."""
    from qerl.kernels import backend_available, use_backend

    if not backend_available("humming"):
        pytest.skip("humming not available")
    previous = use_backend("humming")
    try:
        model = _gpu_model("nvfp4")
        sp = SamplingParams(n=2, greedy=True, max_new_tokens=24, eos_token_ids=(), pad_token_id=0)
        ref = FastEngine().generate(model, PROMPTS, sp)
        eng = FastEngine(single_copy=True)
        eng.generate(model, PROMPTS, sp)  # first call: per-process workspaces (cuBLAS per stream)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        for _ in range(2):
            out = eng.generate(model, PROMPTS, sp)
            assert eng.last_stats["parked_gib"] > 0 and eng._gemms is None
            assert torch.equal(out.completion_ids, ref.completion_ids)
            assert torch.cuda.memory_allocated() <= base  # nothing of the call stays behind
        bufs = [b for n, b in model.named_buffers() if n.endswith("weight_packed")]
        assert bufs and all(b.is_cuda for b in bufs)
    finally:
        use_backend(previous)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fmt,n_rows", [("nvfp4", 1), ("nvfp4", 8), ("mxfp4", 1)])
def test_gpu_gemv_rollout_matches_teacher_forcing(fmt: str, n_rows: int) -> None:
    """``gemv_max_m``: decode through our FP4 GEMV (the 4-bit groups of 7B widths it is preferred
    for, their LoRA beside it, or inside its launch with ``lora_kernel="gemv"``) agrees with a
    full forward pass; a wave wider than ``gemv_max_m`` stays on humming."""
    from qerl.kernels import backend_available, fp4_gemv

    if not backend_available("humming") or not fp4_gemv.supports(
            fmt, 3584, 1, torch.bfloat16, torch.device("cuda")):
        pytest.skip("needs humming-kernels and a GPU of sm_90+")
    model = _model("qwen2", fmt=fmt, lora=True, device="cuda", dtype=torch.bfloat16,
                   hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064, initializer_range=0.02)
    prompts = PROMPTS if n_rows == 8 else PROMPTS[:1]
    sp = SamplingParams(n=n_rows // len(prompts), temperature=1.0, top_p=0.95,
                        max_new_tokens=24, eos_token_ids=(), pad_token_id=0)
    wanted = sum(fp4_gemv.preferred(n, k) for n, k in ((4608, 3584), (3584, 3584), (37888, 3584),
                                                      (3584, 18944)))
    assert wanted == 3  # q/k/v, o, gate/up; the down projection stays on humming
    errs = {}
    runs = [(0, "fused"), (8 if n_rows == 8 else 1, "fused")]  # humming alone, then the GEMV
    runs += [(1, "gemv")] if n_rows == 1 else []  # the LoRA inside the GEMV's launch
    runs += [(1, "long_k")] if n_rows == 1 else []  # the down projection too, K split over CTAs
    for gemv_max_m, lora_kernel in runs:
        long_k = lora_kernel == "long_k"
        eng = FastEngine(gemv_max_m=gemv_max_m, gemv_long_k=long_k,
                         lora_kernel="fused" if long_k else lora_kernel)
        out = eng.generate(model, prompts, sp, generator=torch.Generator().manual_seed(0))
        assert eng.last_stats["cuda_graph"]
        assert eng.last_stats["gemv_groups"] == ((wanted + long_k) * 2 if gemv_max_m else 0)
        inside = gemv_max_m and lora_kernel == "gemv"
        assert eng.last_stats["lora_in_gemv"] == (wanted * 2 if inside else 0)
        errs[gemv_max_m, lora_kernel] = (
            out.logprobs - _teacher_forced_logprobs(model, out, 1.0)).abs()
    ref = errs.pop((0, "fused"))
    for key, gemv in errs.items():
        assert gemv.mean() < 2 * ref.mean() + 0.01 and gemv.max() < 2 * ref.max() + 0.1, (
            key, gemv.mean(), ref.mean(), gemv.max(), ref.max())
    if n_rows == 8:  # a wave wider than gemv_max_m stays on humming
        narrow = FastEngine(gemv_max_m=4)
        narrow.generate(model, prompts, sp, generator=torch.Generator().manual_seed(0))
        assert narrow.last_stats["gemv_groups"] == 0
