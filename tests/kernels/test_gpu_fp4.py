"""GPU checks of the 4-bit paths (skipped without CUDA): humming-kernels and the Triton dequantize
+ cuBLAS path against dequantize-in-float32-then-matmul on odd shapes and on every linear-layer
shape of a 7B (Qwen2.5-7B sizes, random weights), both formats; the training autograd function
(values and x-gradient); the layer's humming cache (built once, rebuilt after a change, our
buffers never modified). Fresh random inputs each time; outputs are checked to be finite."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qerl.kernels import backend_available, dequantize_into, fp4_linear, use_backend
from qerl.quant.formats import FORMATS
from qerl.quant.linear import QuantLinear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
humming = pytest.mark.skipif(not backend_available("humming"), reason="needs humming-kernels")
FMTS = sorted(FORMATS)
SHAPES_7B = [(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944)]  # q/o, k/v, gate/up, down
TOL = 8e-3  # bf16 rounding of the output (and of the input) against a float32 reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _quant(n: int, k: int, fmt: str, scale: float = 0.02) -> dict:
    return FORMATS[fmt].quantize(torch.randn(n, k, device="cuda") * scale)


def _ref(x: torch.Tensor, t: dict, fmt: str) -> torch.Tensor:
    return x.float() @ FORMATS[fmt].dequantize(t, torch.float32).t()


def _members(t: dict):
    return [(t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"))]


@humming
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k,m", [(200, 160, 1), (200, 160, 33), (1000, 544, 7), (96, 256, 64)])
def test_humming_odd_shapes(fmt: str, n: int, k: int, m: int) -> None:
    from qerl.kernels.humming_gemm import HummingFp4

    t = _quant(n, k, fmt)
    before = {name: v.clone() for name, v in t.items()}
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = HummingFp4(fmt, _members(t))(x)
    assert y.shape == (m, n) and torch.isfinite(y).all()
    assert _rel(y, _ref(x, t, fmt)) < TOL
    assert all(torch.equal(t[name].view(torch.uint8), before[name].view(torch.uint8))
               for name in t)  # our buffers untouched


@humming
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k", SHAPES_7B)
def test_humming_every_7b_layer_shape(fmt: str, n: int, k: int) -> None:
    from qerl.kernels.humming_gemm import HummingFp4

    t = _quant(n, k, fmt)
    g = HummingFp4(fmt, _members(t))
    for m in (1, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        assert _rel(g(x), _ref(x, t, fmt)) < TOL


@humming
@pytest.mark.parametrize("n,k", SHAPES_7B + [(200, 160)])
def test_humming_bf16_scales_layout_same_values(n: int, k: int) -> None:
    """NVFP4 with the group scales widened to bf16 and the global scale as ``col_scale``: the same
    product as the compressed-tensors layout (to accumulation order) and the float32 reference;
    our buffers untouched."""
    from qerl.kernels.humming_gemm import HummingFp4

    t = _quant(n, k, "nvfp4")
    before = {name: v.clone() for name, v in t.items()}
    wide, ct = HummingFp4("nvfp4", _members(t), layout="bf16_scales"), HummingFp4("nvfp4", _members(t))
    assert wide.kind == "nvfp4_bf16_scales" and wide.col_scale.shape == (n,)
    assert torch.allclose(wide.col_scale, 1 / t["weight_global_scale"].float().expand(n))
    for m in (1, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = wide(x).float() * wide.col_scale
        assert _rel(y, _ref(x, t, "nvfp4")) < TOL
        assert _rel(y, ct(x)) < TOL
    assert all(torch.equal(t[name].view(torch.uint8), before[name].view(torch.uint8))
               for name in t)


@humming
def test_humming_bf16_scales_layout_refuses_mxfp4() -> None:
    from qerl.kernels.humming_gemm import HummingFp4

    t = _quant(256, 256, "mxfp4")
    with pytest.raises(ValueError, match="nvfp4 only"):
        HummingFp4("mxfp4", _members(t), layout="bf16_scales")


@humming
@pytest.mark.parametrize("fmt,layout", [(f, "ct") for f in FMTS] + [("nvfp4", "bf16_scales")])
def test_humming_stacked_members_with_own_global_scales(fmt: str, layout: str) -> None:
    """q/k/v as one GEMM: NVFP4 members keep their own global scales via ``col_scale``."""
    from qerl.kernels.humming_gemm import HummingFp4

    parts = [_quant(n, 3584, fmt, s) for n, s in ((3584, 0.02), (512, 0.05), (512, 0.01))]
    g = HummingFp4(fmt, [m for t in parts for m in _members(t)], layout=layout)
    assert (g.col_scale is not None) == (fmt == "nvfp4")
    x = torch.randn(64, 3584, device="cuda", dtype=torch.bfloat16)
    y = g(x).float()
    if g.col_scale is not None:
        y = y * g.col_scale
    ref = torch.cat([_ref(x, t, fmt) for t in parts], dim=1)
    for lo, hi in ((0, 3584), (3584, 4096), (4096, 4608)):
        assert _rel(y[:, lo:hi], ref[:, lo:hi]) < TOL


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_dequantize_bit_exact_on_gpu(fmt: str, dtype: torch.dtype) -> None:
    t = _quant(1000, 544, fmt, 0.3)
    out = torch.full((1000, 544), float("nan"), device="cuda", dtype=dtype)
    dequantize_into(out, fmt, *_members(t)[0], impl="triton")
    assert torch.equal(out, FORMATS[fmt].dequantize(t, dtype))


@pytest.mark.parametrize("fp4", ["humming", "triton", "torch"])
@pytest.mark.parametrize("fmt", FMTS)
def test_quantlinear_on_cuda_every_backend(fp4: str, fmt: str) -> None:
    if not backend_available(fp4):
        pytest.skip(f"{fp4} not available")
    previous = use_backend(fp4)
    try:
        lin = nn.Linear(544, 1000, device="cuda")
        lay = QuantLinear.from_linear(lin, fmt).to(torch.bfloat16)
        w = lay.dequantize(torch.float32)
        for m in (8, 1200):  # decode-sized (humming) and training-sized (dequantize + cuBLAS)
            x = torch.randn(m, 544, device="cuda", dtype=torch.bfloat16)
            y = lay(x)
            ref = F.linear(x.float(), w, lay.bias.float())
            assert torch.isfinite(y).all() and _rel(y, ref) < TOL
        assert (len(lay.kernel_cache) == 1) == (fp4 == "humming")
    finally:
        use_backend(previous)


@humming
def test_humming_cache_rebuilt_after_in_place_change() -> None:
    previous = use_backend("humming")
    try:
        lay = QuantLinear.from_linear(nn.Linear(256, 128, bias=False, device="cuda"), "nvfp4")
        x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
        y1 = lay(x)
        first = lay.kernel_cache._items[("humming", torch.bfloat16)][1]
        assert lay.kernel_cache._items[("humming", torch.bfloat16)][1] is first
        lay(x)
        assert lay.kernel_cache._items[("humming", torch.bfloat16)][1] is first  # built once
        with torch.no_grad():
            lay.weight_global_scale.mul_(2.0)  # halves the weight
        y2 = lay(x)
        assert lay.kernel_cache._items[("humming", torch.bfloat16)][1] is not first
        torch.testing.assert_close(y2.float(), y1.float() / 2, rtol=1e-2, atol=1e-3)
    finally:
        use_backend(previous)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [16, 2048])
def test_training_autograd_on_gpu(fmt: str, m: int) -> None:
    """Forward and x-gradient against float32 autograd on the dequantized weight."""
    lay = QuantLinear.from_linear(nn.Linear(1024, 1536, device="cuda"), fmt).to(torch.bfloat16)
    x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = fp4_linear(x, lay)
    gy = torch.randn_like(y)
    y.backward(gy)
    xr = x.detach().float().requires_grad_(True)
    yr = F.linear(xr, lay.dequantize(torch.float32), lay.bias.float())
    yr.backward(gy.float())
    assert _rel(y, yr) < TOL and _rel(x.grad, xr.grad) < TOL
