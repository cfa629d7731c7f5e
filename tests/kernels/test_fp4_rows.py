"""Our FP4 GEMM for 9-64 rows (``qerl.kernels.fp4_rows``, reached through ``Fp4Gemv``): its plan
and errors (CPU); the CUDA kernel against the float32 reference on odd shapes, row counts that are
not whole tiles, stacked weights into a strided view, K split over CTAs with the workspace left
zero, a grid smaller than the items, both formats, and a CUDA-graph replay with PDL (GPU, sm_90+).
The arithmetic (decode, scales, column factors) is the GEMV's, modelled in test_fp4_gemv.py.
"""

from __future__ import annotations

import pytest
import torch

from qerl.kernels import fp4_rows
from qerl.kernels.fp4_gemv import Fp4Gemv
from qerl.kernels.fp4_rows import MAX_ROWS, MIN_ROWS, Fp4Rows

from .test_fp4_gemv import FMTS, TOL, _members, _quant, _ref, _rel, gpu


def test_row_tiles_variant_and_split_by_shape() -> None:
    assert [fp4_rows.row_tiles(m) for m in (9, 16, 17, 32, 33, 64)] == [2, 2, 4, 4, 8, 8]
    for bad in (MIN_ROWS - 1, MAX_ROWS + 1):
        with pytest.raises(ValueError, match="rows, not in 9..64"):
            fp4_rows.row_tiles(bad)
    assert fp4_rows.default_variant(55296, 5120, 32) == (4, 2, 2)
    assert fp4_rows.default_variant(37888, 3584, 64) == (4, 1, 2)  # registers at 64 rows
    # many blocks: no split; few (the down, o and q/k/v projections): about two items an SM
    assert fp4_rows.default_split_k(55296, 5120, (4, 2, 2)) == 1  # 432 blocks
    assert fp4_rows.default_split_k(5120, 27648, (4, 2, 2)) == 7  # 40 blocks
    assert fp4_rows.default_split_k(3584, 18944, (4, 1, 2)) == 5  # 56 blocks
    assert fp4_rows.default_split_k(4608, 512, (4, 2, 2)) == 1  # 4 steps: parts of 4 at least
    assert fp4_rows.default_split_k(4608, 1024, (4, 2, 2)) == 2


def test_plan_and_bad_inputs_raise_before_any_work() -> None:
    t = _quant(64, 1024, "nvfp4")
    g = Fp4Gemv("nvfp4", _members(t))
    assert isinstance(g.rows, Fp4Rows) and g.rows.gemv is g
    assert g.rows.plan(32) == ((4, 2, 2), 2)  # one block: split, at most K / 128 parts
    assert Fp4Rows(g, variant=(8, 1, 3), split_k=16).plan(40) == ((8, 1, 3), 8)  # K: 8 steps
    for bad in ((3, 2, 2), (4, 3, 2), (4, 2, 0), (4, 2), (4, 2.0, 2)):
        with pytest.raises(ValueError, match="Fp4Rows: variant must be"):
            Fp4Rows(g, variant=bad)
    for bad in (0, 17, 2.0):
        with pytest.raises(ValueError, match="split_k must be an int in 1..16"):
            Fp4Rows(g, split_k=bad)
    assert g.nbytes() == 64 * 4  # no workspace before a split launch
    with pytest.raises(ValueError, match=r"x must be bf16 \[1..64, 1024\]"):
        g(torch.zeros(MAX_ROWS + 1, 1024, dtype=torch.bfloat16))


# -- the CUDA kernel -----------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k,m", [(200, 128, 9), (1000, 640, 16), (17, 256, 33), (48, 384, 64),
                                   (4608, 3584, 32), (3584, 3584, 64), (5120, 27648, 32),
                                   (37888, 3584, 20)])
@pytest.mark.parametrize("variant", [None, (4, 1, 1), (2, 4, 2), (8, 2, 3)])
def test_kernel_against_float32(fmt: str, n: int, k: int, m: int, variant) -> None:
    t = _quant(n, k, fmt, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = Fp4Gemv(fmt, _members(t))
    if variant is not None:
        g.rows = Fp4Rows(g, variant=variant)
    y = g(x)
    assert y.shape == (m, n) and torch.isfinite(y).all()
    assert _rel(y, _ref(x, [t], fmt)) < TOL
    for r in (0, m - 1):  # the first and last rows on their own (rows beyond M read as zeros)
        assert _rel(y[r], _ref(x[r:r + 1], [t], fmt)[0]) < TOL, r


@gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pdl,sms", [(False, None), (True, None), (True, 3)])
@pytest.mark.parametrize("split", [1, 3])
def test_stacked_weights_into_a_strided_output(fmt: str, pdl: bool, sms, split: int) -> None:
    """Three weights side by side (different global scales; the last not a whole tile) into a
    view of a wider buffer; ``sms=3``: a few CTAs, each looping over blocks (and parts of K)."""
    ts = [_quant(512, 2048, fmt, device="cuda"), _quant(144, 2048, fmt, device="cuda", scale=0.2),
          _quant(72, 2048, fmt, device="cuda", scale=0.005)]
    x = torch.randn(24, 2048, device="cuda", dtype=torch.bfloat16)
    big = torch.full((24, 800), 7.0, device="cuda", dtype=torch.bfloat16)
    g = Fp4Gemv(fmt, [m for t in ts for m in _members(t)])
    g.rows = Fp4Rows(g, split_k=split)
    y = g(x, out=big[:, 10:738], pdl=pdl, sms=sms)
    assert _rel(y, _ref(x, ts, fmt)) < TOL
    for i, (lo, hi) in enumerate(((0, 512), (512, 656), (656, 728))):  # each member on its own
        assert _rel(y[:, lo:hi], _ref(x, ts[i:i + 1], fmt)) < TOL, i
    assert (big[:, :10] == 7).all() and (big[:, 738:] == 7).all()  # nothing outside the view


@gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("split,sms", [(2, None), (5, None), (7, 2)])
def test_split_k_against_float32_leaves_zeros(fmt: str, split: int, sms) -> None:
    """K split over CTAs, back-to-back launches at several row counts (different variants share
    the workspace and counters): each equals the reference, and the workspace and counters are
    zeros after them; a value left in the workspace joins the next sum (the sums meet there)."""
    k = 2560
    ts = [_quant(208, k, fmt, device="cuda"), _quant(57, k, fmt, device="cuda", scale=0.1)]
    g = Fp4Gemv(fmt, [m for t in ts for m in _members(t)])
    g.rows = Fp4Rows(g, split_k=split)
    for m in (9, 32, 64, 17):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = g(x, pdl=True, sms=sms)
        assert _rel(y, _ref(x, ts, fmt)) < TOL, m
    torch.cuda.synchronize()
    sums, counters = g.rows._split
    assert not sums.any() and not counters.any()
    assert g.nbytes() == 265 * 4 + sums.numel() * 4 + counters.numel() * 4
    sums[0] = 1000.0  # feature 0, row 0 (MROWS 32 at 17 rows: [N, 32] in the kernel)
    y = g(x)
    want = _ref(x, ts, fmt)
    want[0, 0] += 1000.0 * float(g.column_factor[0])
    assert _rel(y, want) < TOL and not sums.any()


@gpu
@pytest.mark.parametrize("split", [None, 3])
def test_cuda_graph_replay_with_pdl_after_the_writer_of_x(split) -> None:
    """Captured behind the kernels that write its input, launched with PDL, twice back to back:
    every replay reads the new input."""
    t = _quant(640, 1024, "nvfp4", device="cuda")
    g = Fp4Gemv("nvfp4", _members(t))
    g.rows = Fp4Rows(g, split_k=split)
    src = torch.randn(32, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(src)
    out = torch.empty(32, 640, device="cuda", dtype=torch.bfloat16)
    x.copy_(src)
    g(x, out=out, pdl=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.copy_(src)
        x.mul_(2.0)
        g(x, out=out, pdl=True)
        g(x, out=out, pdl=True)
    for _ in range(3):
        src.copy_(torch.randn_like(src))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, _ref(src * 2.0, [t], "nvfp4")) < TOL


@gpu
def test_matches_the_gemv_row_by_row() -> None:
    """Row r of a 16-row call equals the GEMV's one-row result for row r to bf16 rounding (the
    same decode and the same float32 sums, another order)."""
    fmt = "nvfp4"
    t = _quant(4608, 3584, fmt, device="cuda")
    g = Fp4Gemv(fmt, _members(t))
    x = torch.randn(16, 3584, device="cuda", dtype=torch.bfloat16)
    y = g(x)
    for r in (0, 7, 15):
        one = g(x[r:r + 1].contiguous())
        assert _rel(y[r], one[0]) < TOL, r
