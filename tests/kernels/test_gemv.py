"""The FP4 GEMV (:mod:`qerl.kernels.gemv`) against dequantize-in-float32-then-matmul, and its
input checks. The kernel runs on CUDA (bf16) or on CPU under ``TRITON_INTERPRET=1`` (float32);
the checks run everywhere."""

from __future__ import annotations

import os

import pytest
import torch

from qerl.kernels import gemv
from qerl.quant.formats import FORMATS

if torch.cuda.is_available():
    DEV, DT, TOL = "cuda", torch.bfloat16, 1e-2
else:
    DEV, DT, TOL = "cpu", torch.float32, 1e-5
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


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


@runs
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m,ns,k,tile", [
    (1, [40], 96, (8, 64, 4)),            # K not a multiple of the chunk, N not of the block
    (3, [24, 16, 8], 160, (8, 64, 4)),    # three members, rows padded to four
    (5, [33, 7], 64, (4, 64, 2)),
    (1, [72, 72, 24], 512, None),         # the default tile
    (8, [50], 1024, None),
])
def test_gemv_matches_the_float32_reference(fmt, m, ns, k, tile) -> None:
    mems, w = _members(fmt, ns, k, seed=m * 100 + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(DEV, DT)
    out = torch.full((m, sum(ns)), float("nan"), dtype=DT, device=DEV)
    y = gemv.fp4_gemv(x, fmt, mems, out=out, config=tile)
    assert y.data_ptr() == out.data_ptr() and y.shape == (m, sum(ns))
    assert not y.isnan().any()
    assert _rel(y, x.float() @ w.t()) < TOL


@runs
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("mul", [True, False])
@pytest.mark.parametrize("ns,k", [([40, 8, 8], 96), ([64], 1024), ([24], 160)])
def test_gemv_one_bf16_row(fmt, mul, ns, k) -> None:
    """The one-row bf16 path (the row read as int32 pairs, both codes of a byte decoded with two
    multiplies or with shifts) against the float32 reference of the same bf16 row."""
    mems, w = _members(fmt, ns, k, seed=k + 7)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).to(DEV, torch.bfloat16)
    y = gemv.fp4_gemv(x, fmt, mems, config=(8, 64 if k < 512 else 512, 4, mul))
    assert y.dtype == torch.bfloat16
    assert _rel(y, x.float() @ w.t()) < 1e-2


@runs
def test_gemv_every_code_and_scale_sign() -> None:
    """All 16 E2M1 codes (the subnormal 0.5 and -0 included) against the codec's values."""
    k = 32
    packed = torch.arange(16, dtype=torch.uint8).repeat(2)  # 32 codes per row: 16 bytes
    packed = (packed[0::2] | (packed[1::2] << 4)).view(1, k // 2).repeat(16, 1)
    ref_t = FORMATS["nvfp4"].quantize(torch.randn(16, k))
    t = {"weight_packed": packed, "weight_scale": ref_t["weight_scale"],
         "weight_global_scale": ref_t["weight_global_scale"]}
    w = FORMATS["nvfp4"].dequantize(t, torch.float32).to(DEV)
    eye = torch.eye(k, dtype=DT, device=DEV)  # row i picks input feature i: y = w^T
    mem = [(packed.to(DEV), t["weight_scale"].to(DEV), t["weight_global_scale"].to(DEV))]
    y = torch.cat([gemv.fp4_gemv(eye[i:i + gemv.MAX_M], "nvfp4", mem)
                   for i in range(0, k, gemv.MAX_M)])
    assert torch.allclose(y.float(), w.t().to(DT).float(), rtol=TOL, atol=0)


@pytest.mark.parametrize("case,msg", [
    ("rows", "1 <= M <= 8"),
    ("members", "1 to 3 members"),
    ("k", "does not fit x"),
    ("gscale", "does not fit x"),
    ("out", "out must be"),
])
def test_gemv_refuses_bad_input(case, msg) -> None:
    mems, _ = _members("nvfp4", [16], 64, seed=0)
    x = torch.zeros(2, 64, dtype=DT, device=DEV)
    kw = {}
    if case == "rows":
        x = torch.zeros(9, 64, dtype=DT, device=DEV)
    elif case == "members":
        mems = mems * 4
    elif case == "k":
        x = torch.zeros(2, 96, dtype=DT, device=DEV)
    elif case == "gscale":
        mems = [(mems[0][0], mems[0][1], None)]
    else:
        kw["out"] = torch.empty(2, 15, dtype=DT, device=DEV)
    with pytest.raises(ValueError, match=msg):
        gemv.fp4_gemv(x, "nvfp4", mems, **kw)


@runs
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("m,k", [(1, 320), (3, 96)])
def test_gemv_with_the_groups_lora_in_its_launch(fmt, m, k) -> None:
    """q/k/v-like members with their own ranks: the base plus ``(x a^T) b^T`` (block diagonal b)
    in one launch, three launches in a row on one counter set with new inputs each time; the
    counters then hold three launches' tickets and shrinks, and the buffer a fourth launch would
    add into is clear."""
    from qerl.rollout.fast.lora import LoraLaunch

    ns, ranks = [48, 16, 16], [8, 4, 4]
    mems, w = _members(fmt, ns, k, seed=k)
    launch = LoraLaunch(ns, ranks, k, torch.device(DEV), on_gemv=True)
    acc = torch.zeros(launch.acc_numel(m), device=DEV)
    cnt = torch.zeros(2, dtype=torch.int64, device=DEV)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(m, k, generator=g).to(DEV, DT)
        a = (torch.randn(sum(ranks), k, generator=g) * 0.1).to(DEV, DT)
        b = torch.zeros(sum(ns), sum(ranks))
        ro = co = 0
        for f, rk in zip(ns, ranks, strict=True):
            b[co:co + f, ro:ro + rk] = torch.randn(f, rk, generator=g) * 0.1
            ro, co = ro + rk, co + f
        b = b.to(DEV, DT)
        y = gemv.fp4_gemv(x, fmt, mems, lora=launch.gemv_lora(a, b, acc, cnt))
        ref = x.float() @ w.t() + (x.float() @ a.float().t()) @ b.float().t()
        assert _rel(y, ref) < TOL, i
    assert cnt.tolist() == [3 * launch.programs(), 3 * launch.split]
    assert not acc[m * sum(ranks):].any()  # launch 3 used buffer 0; buffer 1 was cleared


def test_gemv_lora_refuses_a_launch_that_does_not_fit() -> None:
    from qerl.rollout.fast.lora import LoraLaunch, fused_lora

    mems, _ = _members("nvfp4", [16, 16], 64, seed=0)
    x = torch.zeros(1, 64, dtype=DT, device=DEV)
    launch = LoraLaunch([16, 16], [4, 4], 64, torch.device(DEV), on_gemv=True)
    a = torch.zeros(8, 64, dtype=DT, device=DEV)
    b = torch.zeros(32, 8, dtype=DT, device=DEV)
    acc = torch.zeros(launch.acc_numel(1), device=DEV)
    with pytest.raises(ValueError, match="int64 counters"):
        gemv.fp4_gemv(x, "nvfp4", mems, lora=launch.gemv_lora(a, b, acc, torch.zeros(2)))
    with pytest.raises(ValueError, match="b_full"):
        gemv.fp4_gemv(x, "nvfp4", mems[:1], lora=launch.gemv_lora(
            a, b, acc, torch.zeros(2, dtype=torch.int64)))
    with pytest.raises(ValueError, match="on_gemv"):
        LoraLaunch([16, 16], [4, 4], 64, torch.device(DEV)).gemv_lora(a, b, acc, acc)
    with pytest.raises(ValueError, match="runs in the FP4 GEMV"):
        fused_lora(x, a, b, torch.zeros(1, 32, dtype=DT), acc, torch.zeros(2, dtype=torch.int64),
                   launch)


@pytest.mark.skipif(not gemv.HAS_TRITON, reason="needs Triton")
def test_gemv_kernel_compiles_for_hopper() -> None:
    """PTX for sm_90 with the real compiler (no GPU needed; the interpreter skips its type
    checks): without and with the LoRA (acquire spin-wait, release done-count), 1-3 members."""
    import subprocess
    import sys

    code = """
import re
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.kernels import gemv
fn = gemv._gemv_kernel
P = {a: "i32" for a in fn.arg_names}
P.update({a: "*u8" for a in ("w0", "s0", "w1", "s1", "w2", "s2")})
P.update({a: "*fp32" for a in ("g0", "g1", "g2", "acc_ptr")})
P.update(x_ptr="*bf16", xp_ptr="*i32", y_ptr="*bf16", a_ptr="*bf16", b_ptr="*bf16", cnt_ptr="*i64",
         r0_ptr="*i32")
for nmem, lora, e8m0, row1, mul, mb in ((3, False, False, True, True, 1), (1, False, True, True, False, 1),
                                        (3, True, False, True, True, 1), (2, True, True, False, True, 4)):
    const = dict(NMEM=nmem, HAS_GS=not e8m0, E8M0=e8m0, G=32 if e8m0 else 16, MB=mb, BN=8, BK=512,
                 HAS_LORA=lora, BMS=16, KS=128, BR=32, RS=32, ZB=16, DT=tl.bfloat16, ROW1=row1,
                 MUL=mul)
    sig = {a: ("constexpr" if a in const else P[a]) for a in fn.arg_names}
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                         target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    if lora:
        assert re.search("(ld|atom)[.][^ ]*acquire", ptx), "no acquire load or atomic"
        assert re.search("(red|atom)[.][^ ]*release", ptx), "no release reduction or atomic"
print("compiled")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]
