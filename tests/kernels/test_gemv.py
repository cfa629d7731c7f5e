"""The FP4 GEMV (:mod:`qerl.kernels.gemv`) against dequantize-in-float32-then-matmul, with and
without the group's LoRA in its launch, and its input checks. The kernel runs on CUDA, or on CPU
under ``TRITON_INTERPRET=1`` (its arithmetic on the bf16 row is bit operations and float32, so the
interpreter runs the same math); the checks and the sm_90 compile run everywhere Triton is."""

from __future__ import annotations

import os

import pytest
import torch

from qerl.kernels import gemv
from qerl.quant.formats import FORMATS

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF = torch.bfloat16
TOL = 1e-2  # the bf16 output rounding
RUNS = gemv.HAS_TRITON and (DEV == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
runs = pytest.mark.skipif(not RUNS, reason="needs Triton on CUDA (or TRITON_INTERPRET=1)")


def _members(fmt: str, ns: list[int], k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mems, ws = [], []
    for n in ns:
        t = FORMATS[fmt].quantize(torch.randn(n, k, generator=g) * 0.05)
        ws.append(FORMATS[fmt].dequantize(t, torch.float32))
        t = {key: v.to(DEV) for key, v in t.items()}
        mems.append((t["weight_packed"], t["weight_scale"], t.get("weight_global_scale")))
    return mems, torch.cat(ws).to(DEV)


def _row(k: int, seed: int) -> torch.Tensor:
    return torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).to(DEV, BF)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


@runs
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("ns,k,tile", [
    ([40], 96, (8, 64, 4)),               # chunk lowered to 32 (a divisor of K); N not of the block
    ([24, 16, 8], 160, (8, 512, 4)),      # three members
    ([33, 7], 64, (4, 64, 2)),
    ([72, 72, 24], 512, None),            # the default tile
    ([50], 1024, (16, 256, 4)),
])
def test_gemv_matches_the_float32_reference(fmt, ns, k, tile) -> None:
    mems, w = _members(fmt, ns, k, seed=k + len(ns))
    x = _row(k, k)
    out = torch.full((1, sum(ns)), float("nan"), dtype=BF, device=DEV)
    y = gemv.fp4_gemv(x, fmt, mems, out=out, config=tile)
    assert y.data_ptr() == out.data_ptr() and y.shape == (1, sum(ns))
    assert not y.isnan().any()
    assert _rel(y, x.float() @ w.t()) < TOL


@runs
def test_gemv_every_code_at_every_position() -> None:
    """All 16 E2M1 codes (the subnormal 0.5 and -0 included) at each of the 8 positions of a word:
    one-hot rows pick single weights, which must equal the codec's values."""
    k = 32
    codes = (torch.arange(32) + torch.arange(32) // 16) % 16  # every code in every word slot
    packed = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(1, k // 2).repeat(16, 1)
    ref = FORMATS["nvfp4"].quantize(torch.randn(16, k))
    t = {"weight_packed": packed, "weight_scale": ref["weight_scale"],
         "weight_global_scale": ref["weight_global_scale"]}
    w = FORMATS["nvfp4"].dequantize(t, torch.float32).to(DEV)
    mem = [tuple(v.to(DEV) for v in t.values())]
    eye = torch.eye(k, dtype=BF, device=DEV)
    y = torch.cat([gemv.fp4_gemv(eye[i:i + 1], "nvfp4", mem) for i in range(k)]).float()
    nz = w.t() != 0
    assert torch.equal(y == 0, ~nz) and torch.equal(y.signbit()[nz], w.t().signbit()[nz])
    # one rounding to bf16 (the interpreter truncates instead of rounding: within one bf16 ulp)
    assert torch.allclose(y, w.t(), rtol=2 ** -7, atol=0)


@runs
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("k", [320, 96])
def test_gemv_with_the_groups_lora_in_its_launch(fmt, k) -> None:
    """q/k/v-like members with their own ranks: the base plus ``(x a^T) b^T`` (block diagonal b)
    in one launch, three launches in a row on one counter set with new inputs each time; the
    counters then hold three launches' tickets and shrinks, and the buffer a fourth launch would
    add into is clear."""
    from qerl.rollout.fast.lora import LoraLaunch

    ns, ranks = [48, 16, 16], [8, 4, 4]
    mems, w = _members(fmt, ns, k, seed=k)
    launch = LoraLaunch(ns, ranks, k, torch.device(DEV), on_gemv=True)
    acc = torch.zeros(launch.acc_numel(1), device=DEV)
    cnt = torch.zeros(2, dtype=torch.int64, device=DEV)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(1, k, generator=g).to(DEV, BF)
        a = (torch.randn(sum(ranks), k, generator=g) * 0.1).to(DEV, BF)
        b = torch.zeros(sum(ns), sum(ranks))
        ro = co = 0
        for f, rk in zip(ns, ranks, strict=True):
            b[co:co + f, ro:ro + rk] = torch.randn(f, rk, generator=g) * 0.1
            ro, co = ro + rk, co + f
        b = b.to(DEV, BF)
        y = gemv.fp4_gemv(x, fmt, mems, lora=launch.gemv_lora(a, b, acc, cnt))
        xa = (x.float() @ a.float().t()).to(BF).float()  # the shrink rounded as the cuBLAS path
        ref = x.float() @ w.t() + xa @ b.float().t()
        assert _rel(y, ref) < TOL, i
    assert cnt.tolist() == [3 * launch.programs(), 3 * launch.split]
    assert not acc[sum(ranks):].any()  # launch 3 used buffer 0; buffer 1 was cleared


@pytest.mark.parametrize("case,msg", [
    ("rows", "one bf16 row"),
    ("dtype", "one bf16 row"),
    ("members", "1 to 3 members"),
    ("k", "does not fit x"),
    ("gscale", "does not fit x"),
    ("out", "out must be"),
    ("k48", "not a multiple of 32"),
])
def test_gemv_refuses_bad_input(case, msg) -> None:
    k = 48 if case == "k48" else 64
    mems, _ = _members("nvfp4", [16], k, seed=0)
    x = torch.zeros(1, k, dtype=BF, device=DEV)
    kw = {}
    if case == "rows":
        x = torch.zeros(2, k, dtype=BF, device=DEV)
    elif case == "dtype":
        x = x.float()
    elif case == "members":
        mems = mems * 4
    elif case == "k":
        x = torch.zeros(1, 96, dtype=BF, device=DEV)
    elif case == "gscale":
        mems = [(mems[0][0], mems[0][1], None)]
    elif case == "out":
        kw["out"] = torch.empty(1, 15, dtype=BF, device=DEV)
    with pytest.raises(ValueError, match=msg):
        gemv.fp4_gemv(x, "nvfp4", mems, **kw)


def test_gemv_lora_refuses_a_launch_that_does_not_fit() -> None:
    from qerl.rollout.fast.lora import LoraLaunch, fused_lora

    mems, _ = _members("nvfp4", [16, 16], 64, seed=0)
    x = torch.zeros(1, 64, dtype=BF, device=DEV)
    launch = LoraLaunch([16, 16], [4, 4], 64, torch.device(DEV), on_gemv=True)
    a = torch.zeros(8, 64, dtype=BF, device=DEV)
    b = torch.zeros(32, 8, dtype=BF, device=DEV)
    acc = torch.zeros(launch.acc_numel(1), device=DEV)
    with pytest.raises(ValueError, match="int64 counters"):
        gemv.fp4_gemv(x, "nvfp4", mems, lora=launch.gemv_lora(a, b, acc, torch.zeros(2)))
    with pytest.raises(ValueError, match="b_full"):
        gemv.fp4_gemv(x, "nvfp4", mems[:1], lora=launch.gemv_lora(
            a, b, acc, torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(ValueError, match="on_gemv"):
        LoraLaunch([16, 16], [4, 4], 64, torch.device(DEV)).gemv_lora(a, b, acc, acc)
    with pytest.raises(ValueError, match="runs in the FP4 GEMV"):
        fused_lora(x, a, b, torch.zeros(1, 32, dtype=BF), acc, torch.zeros(2, dtype=torch.int64),
                   launch)


SASS = """
import collections, re, subprocess, sys, tempfile
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.kernels import gemv
fn = gemv._gemv_kernel
names = list(fn.arg_names)
P = {a: "i32" for a in names}
P.update({a: "*i32" for a in ("w0", "w1", "w2", "xp_ptr")})
P.update({a: "*u8" for a in ("s0", "s1", "s2")})
P.update({a: "*fp32" for a in ("g0", "g1", "g2", "acc_ptr")})
P.update(x_ptr="*bf16", y_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16", cnt_ptr="*i64", r0_ptr="*i32")
for nmem, lora, e8m0, bn, bk in ((3, False, False, 16, 512), (1, False, False, 16, 512),
                                 (1, False, False, 64, 256), (1, False, True, 16, 512),
                                 (3, True, False, 16, 512), (2, True, True, 64, 256)):
    const = dict(NMEM=nmem, HAS_GS=not e8m0, E8M0=e8m0, G=32 if e8m0 else 16, BN=bn, BK=bk,
                 HAS_LORA=lora, KS=128, BR=32, RS=32, ZB=16, DT=tl.bfloat16)
    sig = {a: ("constexpr" if a in const else P[a]) for a in names}
    # what the launcher specializes at run time: 16-byte aligned pointers, sizes divisible by 16
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in names
             if a not in const and (P[a].startswith("*") or a in ("K", "SW", "n0", "n1", "n2"))}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    if lora:
        assert re.search("(ld|atom)[.][^ ]*acquire", ptx), "no acquire load or atomic"
        assert re.search("(red|atom)[.][^ ]*release", ptx), "no release reduction or atomic"
    # the codes come in 16-byte loads
    assert "ld.global.v4.b32" in ptx, "weight loads not vectorized"
    if nmem == 1 and not lora:  # the dot product's loop: instructions per code, from the SASS
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"]); f.flush()
            tool = __import__("os").path.join(__import__("os").path.dirname(triton.__file__),
                                              "backends", "nvidia", "bin", "cuobjdump")
            sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        rows = [(int(a, 16), t) for a, t in re.findall(r"/\\*([0-9a-f]{4,})\\*/\\s+(.*?);", sass)]
        back = [(a, int(re.search(r"0x([0-9a-f]+)", t).group(1), 16)) for a, t in rows
                if "BRA" in t and int(re.search(r"0x([0-9a-f]+)", t).group(1), 16) < a]
        a1, a0 = max(back, key=lambda r: r[0] - r[1])
        body = [t for a, t in rows if a0 <= a <= a1]
        codes_per_thread = bn * bk // (4 * 32)
        print("per code", e8m0, bn, bk, len(body) / codes_per_thread, file=sys.stderr)
        assert len(body) / codes_per_thread < float(sys.argv[1]), (len(body), collections.Counter(
            re.sub(r"^@!?U?P\\w+\\s+", "", t).split()[0] for t in body).most_common(12))
print("compiled")
"""


@pytest.mark.skipif(not gemv.HAS_TRITON, reason="needs Triton")
def test_gemv_kernel_compiles_for_hopper() -> None:
    """sm_90 PTX and SASS with the real compiler (no GPU needed; the interpreter skips its type
    checks): with and without the LoRA (an acquire spin-wait, a release done-count), 1-3
    members, 16-byte loads of the codes, and the dot product's loop (the engine's tiles) at most
    6.5 SASS instructions a code (the issue rate allows about 4 at the copy bandwidth: the budget
    the kernel is built to; the first version took 8.9)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SASS, "6.5"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
