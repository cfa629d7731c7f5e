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
