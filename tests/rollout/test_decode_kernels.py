"""The fast engine's Triton decode kernels against plain-torch references (fresh random inputs,
outputs poisoned with NaN first). Run on CUDA; on CPU only under ``TRITON_INTERPRET=1`` (the
interpreter rounds float32 -> bf16 by truncation and mishandles bf16 dots, so CPU runs check
float32 only; the GPU runs bf16, the model dtype)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

K = pytest.importorskip("qerl.rollout.fast.kernels")
A = pytest.importorskip("qerl.rollout.fast.attention")
S = pytest.importorskip("qerl.rollout.fast.sampling")
if not K.HAS_TRITON:
    pytest.skip("needs Triton", allow_module_level=True)
if torch.cuda.is_available():  # float32 dots run as tf32 there: bf16 only
    DEV, DTYPES = "cuda", (torch.bfloat16,)
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEV, DTYPES = "cpu", (torch.float32,)
else:
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)

TOL = {torch.bfloat16: 2e-2, torch.float32: 2e-5}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _group(m: int, n: int, r: int, dt, cs: bool, bias: bool, lora: bool, k: int = 64):
    """Raw output, group vectors and a LoRA output (``(x a^T) b^T`` in the model dtype, as the
    decode step's two GEMMs make it) for an ``[m, n]`` output, and the float32 reference."""
    g = torch.Generator(device=DEV).manual_seed(m * 1000 + n + r)
    raw = torch.randn(m, n, device=DEV, generator=g).to(dt)
    vec = {"col_scale": torch.rand(n, device=DEV, generator=g) + 0.5 if cs else None,
           "bias": torch.randn(n, device=DEV, generator=g).to(dt) if bias else None}
    x = torch.randn(m, k, device=DEV, generator=g).to(dt)
    a = (torch.randn(r, k, device=DEV, generator=g) * 0.2).to(dt)
    b = (torch.randn(n, r, device=DEV, generator=g) * 0.2).to(dt)
    lo = (x @ a.t()) @ b.t() if lora else None
    ref = raw.float()
    if cs:
        ref = ref * vec["col_scale"]
    if bias:
        ref = ref + vec["bias"].float()
    if lora:
        ref = ref + ((x.float() @ a.float().t()) @ b.float().t())
    epi = K.Epilogue(raw=raw, col_scale=vec["col_scale"], bias=vec["bias"], lora=lo)
    return epi, ref, (x, a)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("cs,bias,lora,one_pass_max", [
    (False, False, False, 8192), (True, True, True, 8192), (False, True, True, 8192),
    (True, True, True, 256)])  # a row wider than one pass: two passes of 1,024 features
def test_add_rmsnorm_with_epilogue(dt, cs, bias, lora, one_pass_max) -> None:
    m, hid = 6, 320
    epi, d_ref, _ = _group(m, hid, 12, dt, cs, bias, lora)
    g = torch.Generator(device=DEV).manual_seed(1)
    h = torch.randn(m, hid, device=DEV, generator=g).to(dt)
    w = (torch.rand(hid, device=DEV, generator=g) + 0.5).to(dt)
    h_ref = (h.float() + d_ref.to(dt).float()).to(dt)
    hf = h_ref.float()
    x_ref = w.float() * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dt).float()
    x = K.add_rmsnorm(h, w, 1e-6, epi, one_pass_max=one_pass_max)
    assert _rel(h, h_ref) < TOL[dt] and _rel(x, x_ref) < TOL[dt]
    x0 = K.add_rmsnorm(h.clone(), w, 1e-6, None, one_pass_max=one_pass_max)  # plain RMSNorm
    hf = h.float()
    assert _rel(x0, w.float() * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6))) \
        < TOL[dt]


def _qkv_group(m: int, hq: int, hkv: int, d: int, dt, lora: bool, seed: int = 0,
               vecs: bool = True):
    """A q/k/v group's epilogue (column scale and bias with ``vecs``, LoRA; its raw output q's),
    the float32 reference of the whole finished output, and k's and v's raw outputs."""
    epi, ref, _ = _group(m, (hq + 2 * hkv) * d, 24 + seed, dt, vecs, vecs, lora)
    raw = epi.raw
    epi.raw = raw[:, :hq * d]
    return epi, ref, raw[:, hq * d:(hq + hkv) * d], raw[:, (hq + hkv) * d:]


def _finished(epi, k: torch.Tensor, v: torch.Tensor, dt) -> torch.Tensor:
    """The q/k/v group's output finished from exactly what the kernel reads (its LoRA output in
    the model dtype, as the decode step hands it over), in float32, rounded to ``dt``."""
    y = torch.cat([epi.raw, k, v], 1).float()
    if epi.col_scale is not None:
        y = y * epi.col_scale
    if epi.bias is not None:
        y = y + epi.bias.float()
    if epi.lora is not None:
        y = y + epi.lora.float()
    return y.to(dt).float()


def _rot(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], -1)


def _attention_ref(q, kc, vc, pad, slot, scale):
    m, hq, d = q.shape
    ref = torch.empty(m, hq, d, device=q.device)
    for b in range(m):
        lo = int(pad[b])
        kk = kc[b, :, lo:slot + 1].float().repeat_interleave(hq // kc.shape[1], 0)
        vv = vc[b, :, lo:slot + 1].float().repeat_interleave(hq // kc.shape[1], 0)
        w = torch.softmax((q[b].float().unsqueeze(1) @ kk.transpose(1, 2)) * scale, -1)
        ref[b] = (w @ vv).squeeze(1)
    return ref.reshape(m, hq * d)


def _rope_attention_ref(full, kc, vc, pad, at, inv, hq, d, dt):
    """From a finished q/k/v output ``full``: the rotated new K and V, the caches with them at
    slot ``at``, and the attention of every row and head over its slots ``pad .. at``."""
    m, hkv = full.shape[0], kc.shape[1]
    f = (at - pad).float()[:, None] * inv[None, :]
    cos = torch.cat([f, f], -1).cos()[:, None] * 0.9
    sin = torch.cat([f, f], -1).sin()[:, None] * 0.9
    q = full[:, :hq * d].view(m, hq, d)
    k = full[:, hq * d:(hq + hkv) * d].view(m, hkv, d)
    v = full[:, (hq + hkv) * d:].view(m, hkv, d)
    q_rot, k_rot = (q * cos + _rot(q) * sin).to(dt), (k * cos + _rot(k) * sin).to(dt)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc_ref[:, :, at], vc_ref[:, :, at] = k_rot, v.to(dt)
    return k_rot, v, kc_ref, vc_ref, _attention_ref(q_rot, kc_ref, vc_ref, pad, at, 0.3).view(
        m, hq, d)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m,hq,hkv,d,splits,slot,pads,lora,vecs", [
    (3, 4, 2, 32, 1, 150, None, True, True), (2, 6, 2, 16, 3, 150, None, False, True),
    (4, 8, 2, 64, 5, 150, None, True, True), (1, 28, 4, 128, 6, 150, None, True, True),
    (20, 4, 4, 16, 1, 9, None, False, False),  # no column scale, no bias
    (3, 6, 2, 48, 2, 100, None, True, False),  # head_dim not a power of two (padded to 64)
    # 7 splits of 71 slots: the rows with short contexts have empty splits
    (5, 8, 2, 32, 7, 70, [0, 3, 64, 10, 69], True, True),
    (5, 8, 2, 32, 4, 200, [0, 3, 64, 10, 69], False, True)])
def test_rope_attention_against_torch(dt, m, hq, hkv, d, splits, slot, pads, lora, vecs) -> None:
    """The q/k/v epilogue, RoPE and the cache write inside the attention's launch: the rotated new
    K and V at ``slot`` (nothing else of the cache written), each row and head attending exactly
    its slots ``pad .. slot``, split or not; the last split of each (row, KV head) merges them and
    leaves its counter at zero, so the same counters serve the next call (other inputs, a later
    slot)."""
    g = torch.Generator(device=DEV).manual_seed(m + d)
    cap = slot + 50
    kc = torch.randn(m, hkv, cap, d, device=DEV, generator=g).to(dt)
    vc = torch.randn(m, hkv, cap, d, device=DEV, generator=g).to(dt)
    kc[:, :, slot:] = float("nan")  # slot: written by the kernel; beyond: never read
    vc[:, :, slot:] = float("nan")
    pad = (torch.tensor(pads, dtype=torch.int32) if pads else
           torch.randint(0, slot // 2 + 1, (m,), dtype=torch.int32)).to(DEV)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    cnt = torch.zeros(m * hkv, dtype=torch.int32, device=DEV)
    for step in range(2):  # the second call: other q/k/v, the next slot, the same counters
        at = slot + step
        epi, ref, kv, vv = _qkv_group(m, hq, hkv, d, dt, lora, seed=step, vecs=vecs)
        # per head against what the kernel is given (a bf16 LoRA output moves single heads of
        # the float32 reference's output by up to a few %); as a whole against float32
        k_rot, v, kc_ref, vc_ref, want = _rope_attention_ref(_finished(epi, kv, vv, dt), kc, vc,
                                                             pad, at, inv, hq, d, dt)
        want_f32 = _rope_attention_ref(ref.to(dt).float(), kc, vc, pad, at, inv, hq, d, dt)[-1]
        sl = torch.tensor([at], device=DEV, dtype=torch.int32)
        out = A.rope_attention(epi, kv, vv, kc, vc, inv, sl, pad, 0.9, hq, d, 0.3, splits, cnt)
        keep = torch.ones(cap, dtype=torch.bool, device=DEV)
        keep[at] = False
        torch.testing.assert_close(kc[:, :, keep], kc_ref[:, :, keep], equal_nan=True, rtol=0,
                                   atol=0)  # nothing but the slot written
        torch.testing.assert_close(vc[:, :, keep], vc_ref[:, :, keep], equal_nan=True, rtol=0,
                                   atol=0)
        for b in range(m):  # every row and KV head's new K/V, every row and head's output
            for h in range(hkv):
                assert _rel(kc[b, h, at], k_rot[b, h]) < TOL[dt] / 4
                assert _rel(vc[b, h, at], v[b, h]) < TOL[dt] / 4
            for h in range(hq):
                assert _rel(out.view(m, hq, d)[b, h], want[b, h]) < TOL[dt], (b, h)
        assert _rel(out.view(m, hq, d), want_f32) < TOL[dt]
        assert not cnt.any()
    with pytest.raises(ValueError, match="counters must be int32 zeros of at least"):
        A.rope_attention(epi, kv, vv, kc, vc, inv, sl, pad, 0.9, hq, d, 0.3, 2,
                         torch.zeros(3, dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="rows"):
        A.rope_attention(epi, kv, vv, torch.cat([kc, kc[:1]]), vc, inv, sl, pad, 0.9, hq, d, 0.3,
                         1, cnt)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m,inter,lora", [(4, 200, True), (17, 128, False), (64, 384, True)])
def test_silu_mul_epilogue(dt, m, inter, lora) -> None:
    epi, ref, _ = _group(m, 2 * inter, 16, dt, True, True, lora)
    raw = epi.raw
    epi.raw, up = raw[:, :inter], raw[:, inter:]
    full = ref.to(dt).float()
    act_ref = (F.silu(full[:, :inter]).to(dt).float() * full[:, inter:]).to(dt)
    act = K.silu_mul(epi, up)
    assert _rel(act, act_ref) < TOL[dt]


def test_attention_splits_only_when_programs_would_leave_sms_idle() -> None:
    assert A.MIN_SPLIT_SLOTS == 64
    assert A.attention_splits(64, 4, 1280, 132) == 1  # 256 programs: no split
    assert A.attention_splits(1, 4, 1280, 132) == 20  # capacity bound: >= 64 slots a split
    assert A.attention_splits(1, 4, 384, 132) == 6
    assert A.attention_splits(1, 4, 16384, 132) == 32  # at most 32
    assert A.attention_splits(8, 4, 8192, 132) == 9  # about two waves: ceil(264 / 32)
    assert A.attention_splits(1, 8, 100, 132) == 1


def _logits(kind: str, b: int, v: int, dt: torch.dtype) -> torch.Tensor:
    """Sampling inputs: peaked, near uniform, coarse (many tied logits) or with -inf entries."""
    g = torch.Generator(device=DEV).manual_seed(sum(map(ord, kind)) + v)
    x = torch.randn(b, v, device=DEV, generator=g)
    if kind == "peaked":
        x = x * 4
    elif kind == "flat":
        x = x * 0.01
    elif kind == "ties":
        x = (x * 2).round() / 2
    elif kind == "masked":
        x = (x * 3).masked_fill(torch.rand(b, v, device=DEV, generator=g) < 0.3, float("-inf"))
    return x.to(dt)


def _near_a_boundary(x: torch.Tensor, u: float, temp: float, top_p: float, tok: int, tol: float = 1e-5) -> bool:
    """Whether drawing ``tok`` from row ``x`` with uniform ``u`` is right up to float32 rounding:
    in float64, ``u`` times the kept mass lies within ``tol`` of an end of ``tok``'s CDF interval,
    or ``tok`` sits within ``tol`` of the nucleus' edge (the kernel and torch sum in other orders)."""
    p = torch.softmax(x.double() / temp, -1)
    above = (p * (x.double() > x[tok].double())).sum()
    if abs(float(above) - top_p) <= tol:
        return True
    keep = torch.tensor([float((p * (x.double() > x[i].double())).sum()) < top_p for i in range(len(x))])
    c = (p * keep).cumsum(-1)
    target = u * float(c[-1])
    lo, hi = float(c[tok] - p[tok] * keep[tok]), float(c[tok])
    return bool(keep[tok]) and (abs(target - lo) <= tol or abs(target - hi) <= tol)


@pytest.mark.parametrize("dt", (torch.float32, torch.bfloat16))  # no rounding inside: bf16 on CPU too
@pytest.mark.parametrize("kind,v", [("peaked", 3001), ("flat", 5000), ("ties", 2048), ("masked", 700),
                                    ("peaked", 50)])
@pytest.mark.parametrize("mode", ["greedy", "full", "top_p"])
@pytest.mark.parametrize("chunk", [64, 4096])  # many chunks a row (and a partial last one), or one
def test_sample_kernel_matches_the_torch_reference(dt, kind, v, mode, chunk) -> None:
    """Same tokens as the torch reference, except where float32 rounding decides (checked in
    float64); log-probs and entropies of the drawn tokens to float32 precision."""
    from qerl.rollout.fast.sampling import sample_tokens_torch

    b = 7
    logits = _logits(kind, b, v, dt)
    u = torch.rand(b, device=DEV, generator=torch.Generator(device=DEV).manual_seed(v))
    for temp, top_p in ((1.0, 0.9), (0.7, 0.5), (1.3, 1.0)):
        t = torch.tensor([temp], device=DEV)
        p = torch.tensor([top_p], device=DEV)
        tok, lp, ent = S.sample_kernel(logits, u, t, p, mode, chunk=chunk)
        rtok, _, rent = sample_tokens_torch(logits, u, t, p, mode)
        assert tok.dtype == torch.long and tok.shape == (b,)
        for i in torch.nonzero(tok != rtok).flatten().tolist():
            assert mode != "greedy" and _near_a_boundary(logits[i].cpu(), float(u[i]), temp,
                                                         top_p if mode == "top_p" else 1.0, int(tok[i])), (i, temp)
        z = logits.float() / (1.0 if mode == "greedy" else temp)
        torch.testing.assert_close(lp, torch.log_softmax(z, -1).gather(-1, tok[:, None]).squeeze(-1),
                                   atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ent, rent, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dt", (torch.float32, torch.bfloat16))
def test_sample_top_p_with_chunks_wholly_outside_the_search_interval(dt) -> None:
    """Chunks of 64 logits: one all near 5 (89 % of the mass: above the nucleus' edge), one
    spread over [1, 4], two near 0 (the edge in one of those, by top_p): the search takes its
    shortcuts for the chunks wholly above or below a level's interval and still draws the torch
    reference's tokens, on both sides of the first chunk."""
    from qerl.rollout.fast.sampling import sample_tokens_torch

    g = torch.Generator(device=DEV).manual_seed(5)
    row = torch.cat([5.0 + 0.05 * torch.randn(64, generator=g, device=DEV),
                     torch.linspace(1.0, 4.0, 64, device=DEV),
                     0.3 * torch.randn(128, generator=g, device=DEV)])
    b = 32
    logits = row.expand(b, -1).contiguous().to(dt)
    u = torch.linspace(0.0, 0.999, b, device=DEV)  # the whole kept CDF, its top end included
    t = torch.ones(1, device=DEV)
    for top_p in (0.9, 0.97, 0.995):
        p = torch.tensor([top_p], device=DEV)
        tok, lp, _ = S.sample_kernel(logits, u, t, p, "top_p", chunk=64)
        full_search = S.sample_kernel(logits, u, t, p, "top_p", chunk=64, skip=False)
        assert torch.equal(tok, full_search[0]) and torch.equal(lp, full_search[1])  # shortcut: same
        rtok = sample_tokens_torch(logits, u, t, p, "top_p")[0]
        for i in torch.nonzero(tok != rtok).flatten().tolist():
            assert _near_a_boundary(logits[i].cpu(), float(u[i]), 1.0, top_p, int(tok[i])), i
        assert (tok >= 64).any() and (tok < 64).any(), top_p  # draws on both sides of chunk 0
        torch.testing.assert_close(lp, torch.log_softmax(logits.float(), -1).gather(
            -1, tok[:, None]).squeeze(-1), atol=2e-5, rtol=1e-5)


def test_sample_kernel_compiles_for_hopper() -> None:
    """The real compiler's type checks (the interpreter runs the kernel without them): PTX for
    sm_90 in a process without ``TRITON_INTERPRET``; no GPU needed."""
    import subprocess
    import sys

    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.rollout.fast import sampling as S
P = {"x_ptr": "*bf16", "sx": "i32", "u_ptr": "*fp32", "t_ptr": "*fp32", "p_ptr": "*fp32", "st_ptr": "*fp32",
     "arg_ptr": "*fp32", "part_ptr": "*fp32", "lo_ptr": "*i64", "tok_ptr": "*i64", "lp_ptr": "*fp32",
     "ent_ptr": "*fp32", "V": "i32", "B": "i32", "C": "i32"}
def build(fn, **const):
    names = fn.arg_names
    sig = {a: ("constexpr" if a in const else P[a]) for a in names}
    if const.get("KEY_BITS") == 32:  # float32 logits
        sig["x_ptr"] = "*fp32"
    src = ASTSource(fn=fn, signature=sig, constexprs=const)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    assert fn.__name__ in ptx, fn.__name__
for bits in (16, 32):
    levels = bits // 4
    for mode in (0, 1, 2):
        build(S._stats_kernel, MODE=mode, KEY_BITS=bits, CHUNK=4096)
        build(S._pick_kernel, MODE=mode, LEVELS=levels, KEY_BITS=bits, CHUNK=4096, CP2=64)
    for level in (1, 2, levels - 1):
        for skip in (True, False):
            build(S._nucleus_kernel, LEVEL=level, KEY_BITS=bits, CHUNK=4096, CP2=64, SKIP=skip)
print("compiled")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("mode", ["greedy", "full", "top_p"])
def test_sample_kernel_non_finite_rows_give_nan_and_a_valid_token(mode) -> None:
    """A row of -inf logits, or one with a NaN, gets a NaN log-prob and entropy (what the torch
    reference gives, and what the trainer's non-finite guards look for) and token 0, never an
    out-of-range id that the next step's embedding would read; the finite rows are unaffected."""
    from qerl.rollout.fast.sampling import sample_tokens_torch

    x = torch.randn(3, 2500, device=DEV) * 2
    x[0] = float("-inf")
    x[1, 1234] = float("nan")
    u = torch.tensor([0.3, 0.6, 0.9], device=DEV)
    t, p = torch.tensor([0.9], device=DEV), torch.tensor([0.8], device=DEV)
    tok, lp, ent = S.sample_kernel(x, u, t, p, mode)
    rtok, rlp, rent = sample_tokens_torch(x, u, t, p, mode)
    assert tok[:2].tolist() == [0, 0] and torch.isnan(lp[:2]).all() and torch.isnan(ent[:2]).all()
    assert torch.isnan(rlp[:2]).all() and torch.isnan(rent[:2]).all()
    assert int(tok[2]) == int(rtok[2]) and torch.allclose(lp[2], rlp[2], atol=2e-5)


# ------------------------------------------------------------------ the fused LoRA kernel

L = pytest.importorskip("qerl.rollout.fast.lora")


def _lora_problem(m: int, k: int, out_f: list[int], ranks: list[int], dt):
    """x, a_cat, a block-diagonal b_full (the plan's layout) and the float32 reference."""
    g = torch.Generator(device=DEV).manual_seed(m * 7 + k + sum(out_f))
    x = torch.randn(m, k, device=DEV, generator=g).to(dt)
    a = (torch.randn(sum(ranks), k, device=DEV, generator=g) * k ** -0.5).to(dt)
    b = torch.zeros(sum(out_f), sum(ranks), device=DEV, dtype=dt)
    ro = co = 0
    for f, rk in zip(out_f, ranks, strict=True):
        b[co:co + f, ro:ro + rk] = (torch.randn(f, rk, device=DEV, generator=g) * 0.3).to(dt)
        ro, co = ro + rk, co + f
    return x, a, b, (x.float() @ a.float().t()) @ b.float().t()


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("m,k,out_f,ranks", [
    (1, 3584, [3584, 512, 512], [32, 32, 32]),   # 7B q/k/v at B=1: tiles inside one member each
    (64, 1300, [384, 128, 128], [8, 8, 8]),      # the most rows it takes
    (5, 700, [200, 56], [4, 12]),                # a tile straddles two members: the whole rank
    (3, 2500, [130], [16]),                      # one member, a partial last tile
    (7, 640, [256, 256], [0, 16]),               # a member without adapters
    (1, 3584, [256], [8]),                       # fewer accumulator values (8) than shrink slices (28)
])
def test_fused_lora_equals_two_gemms(dt, m, k, out_f, ranks) -> None:
    x, a, b, ref = _lora_problem(m, k, out_f, ranks, dt)
    lau = L.LoraLaunch(out_f, ranks, k, torch.device(DEV))
    acc = torch.zeros(lau.acc_numel(m), device=DEV)
    assert acc.numel() == 2 * m * sum(ranks)  # two buffers, alternate launches
    cnt = torch.zeros(2, dtype=torch.int64, device=DEV)
    for i in range(1, 4):  # each launch runs on the state the previous one left, new inputs each
        if i > 1:
            x = torch.randn_like(x.float()).to(dt)
            ref = x.float() @ a.float().t() @ b.float().t()
        out = torch.full((m, sum(out_f)), float("nan"), device=DEV, dtype=dt)
        L.fused_lora(x, a, b, out, acc, cnt, lau)
        assert cnt.tolist() == [i * lau.programs(), i * lau.split]  # tickets, shrinks done
        nxt = acc.view(2, -1)[i % 2]  # the buffer launch i + 1 adds into: cleared by launch i
        assert not bool(nxt.any())
        assert _rel(out, ref) < TOL[dt], _rel(out, ref)
    assert _rel(out, L.lora_torch(x, a, b)) < TOL[dt]


def test_fused_lora_rejects_more_rows_than_it_takes() -> None:
    x, a, b, _ = _lora_problem(L.MAX_ROWS + 1, 64, [32], [16], DTYPES[0])
    lau = L.LoraLaunch([32], [16], 64, torch.device(DEV))
    with pytest.raises(ValueError, match=f"at most {L.MAX_ROWS} rows"):
        L.fused_lora(x, a, b, torch.empty(x.shape[0], 32, device=DEV, dtype=x.dtype),
                     torch.empty(lau.acc_numel(x.shape[0]), device=DEV),
                     torch.zeros(2, dtype=torch.int64, device=DEV), lau)
    x, a, b, _ = _lora_problem(2, 64, [32], [16], DTYPES[0])
    with pytest.raises(ValueError, match="do not match the launch"):  # another group's launch
        L.fused_lora(x, a, b, torch.empty(2, 32, device=DEV, dtype=x.dtype),
                     torch.zeros(64, device=DEV), torch.zeros(2, dtype=torch.int64, device=DEV),
                     L.LoraLaunch([32], [8], 64, torch.device(DEV)))
    with pytest.raises(ValueError, match="acc holds 8 values, 64 needed"):
        L.fused_lora(x, a, b, torch.empty(2, 32, device=DEV, dtype=x.dtype),
                     torch.zeros(8, device=DEV), torch.zeros(2, dtype=torch.int64, device=DEV), lau)
    with pytest.raises(ValueError, match="int64 counters"):
        L.fused_lora(x, a, b, torch.empty(2, 32, device=DEV, dtype=x.dtype),
                     torch.zeros(lau.acc_numel(2), device=DEV),
                     torch.zeros(3, dtype=torch.int32, device=DEV), lau)
    with pytest.raises(ValueError, match="beside=True needs pdl=True"):  # nothing to wait with
        L.fused_lora(x, a, b, torch.empty(2, 32, device=DEV, dtype=x.dtype),
                     torch.zeros(lau.acc_numel(2), device=DEV),
                     torch.zeros(2, dtype=torch.int64, device=DEV), lau, beside=True)
    with pytest.raises(ValueError, match="end_wait must be one or all"):
        L.fused_lora(x, a, b, torch.empty(2, 32, device=DEV, dtype=x.dtype),
                     torch.zeros(lau.acc_numel(2), device=DEV),
                     torch.zeros(2, dtype=torch.int64, device=DEV), lau, end_wait="some")


def test_fused_lora_kernel_compiles_for_hopper() -> None:
    """PTX for sm_90 with the real compiler (no GPU needed): the spin-wait is an acquire load, the
    done-count a release reduction, the shrink float atomic additions; with PDL, every program
    waits for the kernel before it (``griddepcontrol.wait``) before its ticket, the first atomic,
    and only then lets the next kernel launch; beside the GEMM, it waits after its last store."""
    import subprocess
    import sys

    code = """
import re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.rollout.fast import lora as L
P = {"x_ptr": "*bf16", "sx": "i32", "a_ptr": "*bf16", "b_ptr": "*bf16", "acc_ptr": "*fp32",
     "lo_ptr": "*bf16", "slo": "i32", "cnt_ptr": "*i64", "r0_ptr": "*i32", "M": "i32", "K": "i32",
     "R": "i32", "N": "i32", "SPLIT": "i32"}
fn = L._lora_kernel
for (bm, br, bk), pdl, beside, one in (((16, 128, 128), False, False, False),
                                        ((64, 32, 256), False, False, False),
                                        ((16, 128, 128), True, False, False),
                                        ((16, 128, 128), True, True, False),
                                        ((16, 128, 128), True, True, True)):
    const = dict(BM=bm, BK=bk, BR=br, RS=32, BN=128, ZB=64, DT=tl.bfloat16, PDL=pdl, BESIDE=beside,
                 ONE_WAITER=one)
    sig = {a: ("constexpr" if a in const else P[a]) for a in fn.arg_names}
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    # (the order of the qualifiers differs between Triton releases)
    assert re.search("(ld|atom)[.][^ ]*acquire", ptx), "no acquire load or atomic"
    assert re.search("(red|atom)[.][^ ]*release", ptx), "no release reduction or atomic"
    assert re.search("(red|atom)[.]global[.][^ ]*add[.]f32", ptx), "no float atomic additions"
    first_atom = re.search("(atom|red)[.]", ptx).start()
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    if beside:  # launched beside the GEMM: no wait before the work, one after the last store
        last_store = max(m.start() for m in re.finditer("st[.]global", ptx))
        assert 0 <= launch < first_atom < last_store < wait, (launch, first_atom, last_store, wait)
        assert "ld.global.cg" in ptx  # x read at L2
    elif pdl:
        assert 0 <= wait < launch < first_atom, (wait, launch, first_atom)
    else:
        assert "griddepcontrol" not in ptx
print("compiled")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]


def test_decode_kernels_wait_for_their_predecessor_first_with_pdl() -> None:
    """PTX for sm_90 (no GPU needed): with ``PDL`` a decode kernel's first instruction of note is
    ``griddepcontrol.wait`` (before any global load), then ``launch_dependents``; without it,
    neither. The attention's merge of its splits: the partials stored, a CTA barrier, the
    acquire-release count, a barrier, then the partials read back at L2 (``ld.global.cg``)."""
    import subprocess
    import sys

    code = """
import re
import triton.language as tl
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.rollout.fast import attention as A
from qerl.rollout.fast import kernels as K
cases = {
    K._add_rmsnorm_kernel: ({"h_ptr": "*bf16", "d_ptr": "*bf16", "sd": "i32", "off": "i32",
                             "cs_ptr": "*fp32", "b_ptr": "*bf16", "lo_ptr": "*bf16", "slo": "i32",
                             "w_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32", "eps": "fp32"},
                            dict(HAS_ADD=True, HAS_CS=True, HAS_BIAS=False, HAS_LORA=True,
                                 CH=4096, ONE=True)),
    K._silu_mul_kernel: ({"g_ptr": "*bf16", "u_ptr": "*bf16", "sg": "i32", "su": "i32",
                          "cs_ptr": "*fp32", "b_ptr": "*bf16", "lo_ptr": "*bf16", "slo": "i32",
                          "act_ptr": "*bf16", "M": "i32", "NI": "i32"},
                         dict(HAS_CS=True, HAS_BIAS=False, HAS_LORA=True, BM=16, BN=128)),
    A._attn_kernel: ({**{p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "b_ptr", "lo_ptr", "kc_ptr",
                                                "vc_ptr", "o_ptr")},
                      **{p: "*fp32" for p in ("cs_ptr", "invf_ptr", "pacc_ptr", "pm_ptr", "pl_ptr")},
                      **{p: "*i32" for p in ("slot_ptr", "pad_ptr", "cnt_ptr")},
                      **{p: "i32" for p in ("sq", "sk", "sv", "slo", "skb", "skh", "skl", "so")},
                      "rope_scale": "fp32", "qk_scale": "fp32"},
                     dict(HQ=28, HKV=4, G=7, GP=16, D=128, DP=128, BL=64, S=6, HAS_CS=True,
                          HAS_BIAS=True, HAS_LORA=True)),
}
for fn, (types, const) in cases.items():
    for pdl in (False, True):
        c = {**const, "PDL": pdl}
        sig = {a: ("constexpr" if a in c else types[a]) for a in fn.arg_names}
        ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c),
                             target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
        first_load = re.search("ld[.]global", ptx).start()
        if pdl:
            wait = ptx.find("griddepcontrol.wait")
            launch = ptx.find("griddepcontrol.launch_dependents")
            assert 0 <= wait < launch < first_load, (fn.__name__, wait, launch, first_load)
        else:
            assert "griddepcontrol" not in ptx, fn.__name__
        if fn is A._attn_kernel and pdl:  # the merge of the splits: stores, barrier, count, barrier, loads
            atom = re.search("atom[.]global[.][^ ]*acq_rel[.]add", ptx).start()
            last_st = max(m.start() for m in re.finditer("st[.]global", ptx[:atom]))
            assert "bar.sync" in ptx[last_st:atom], "no barrier between the partials and the count"
            cg = ptx.find("ld.global.cg", atom)
            assert cg > atom and "bar.sync" in ptx[atom:cg] and "ld.global.cg" not in ptx[:atom]
print("compiled")
"""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
