"""Our FP4 GEMV (``qerl.kernels.fp4_gemv``): its arithmetic modelled in torch on the CPU (the bit
decode of the ``.cu`` file, the float16 scale products, the MXFP4 exponent bias) against the
float32 reference; what it prepares and the errors it raises (CPU); the CUDA kernel itself against
the reference on odd shapes, every 7B layer shape, stacked weights and both formats (GPU, sm_90+).
"""

from __future__ import annotations

import pytest
import torch

from qerl.kernels import fp4_gemv
from qerl.kernels.fp4_gemv import MAX_M, Fp4Gemv, mx_bias, supports
from qerl.quant.formats import FORMATS, e2m1_decode, unpack_fp4

FMTS = ["mxfp4", "nvfp4"]


def _quant(n: int, k: int, fmt: str, device="cpu", scale: float = 0.02) -> dict:
    return FORMATS[fmt].quantize(torch.randn(n, k, device=device) * scale)


def _members(t: dict):
    return [(t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"))]


def _ref(x: torch.Tensor, ts: list[dict], fmt: str) -> torch.Tensor:
    w = torch.cat([FORMATS[fmt].dequantize(t, torch.float32) for t in ts])
    return x.float() @ w.t()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _decode8(words: torch.Tensor) -> torch.Tensor:
    """The ``.cu`` file's ``decode8`` on int64 words: ``[..., 4]`` f16x2 bit patterns, pair q
    holding nibble q (low half) and nibble q + 4 (high half)."""
    out = []
    w = words.clone()
    for _ in range(4):
        out.append((w & 0x80008000) | ((w >> 3) & 0x0E000E00))
        w = (w << 4) & 0xFFFFFFFF
    return torch.stack(out[::-1], -1)


def _halves(bits: torch.Tensor) -> torch.Tensor:
    """f16x2 bit patterns (int64) ``[...]`` -> float32 ``[..., 2]`` (low half first)."""
    pair = torch.stack([bits & 0xFFFF, (bits >> 16) & 0xFFFF], -1)
    pair = torch.where(pair >= 1 << 15, pair - (1 << 16), pair)  # as signed 16-bit
    return pair.to(torch.int16).view(torch.float16).float()


def test_decode_bits_give_e2m1_times_2_pow_minus_14() -> None:
    codes = torch.arange(16, dtype=torch.int64)
    # every code in every nibble position of a word
    words = torch.zeros(16, dtype=torch.int64)
    for q in range(8):
        words |= torch.roll(codes, q) << (4 * q)
    pairs = _decode8(words)  # [16, 4]
    vals = torch.stack([_halves(pairs[:, q]) for q in range(4)], 1)  # [16, 4 (q), 2 (lo, hi)]
    for q in range(4):
        for h in range(2):
            nib = (words >> (4 * (q + 4 * h))) & 15
            want = e2m1_decode(nib.to(torch.uint8)).float() * 2.0 ** -14
            assert torch.equal(vals[:, q, h], want), (q, h)


def _model(x: torch.Tensor, ts: list[dict], fmt: str) -> torch.Tensor:
    """The kernel's arithmetic in torch: decoded codes (e2m1 * 2^-14, float16) times the group
    scale as float16, rounded to float16; activations in float16; float32 sums; the column factor."""
    g = Fp4Gemv(fmt, [m for t in ts for m in _members(t)])
    spec = FORMATS[fmt]
    e2m1 = e2m1_decode(unpack_fp4(torch.cat(g.weights))).float()  # [N, K]
    dec = (e2m1 * 2.0 ** -14).half()
    raw = torch.cat(g.scales).repeat_interleave(spec.block_size, 1)
    if fmt == "nvfp4":
        s16 = (raw.view(torch.float8_e4m3fn).float() * 2.0 ** 7).half()
    else:
        e = (raw.int() - g.mx_bias).clamp(0, 30)
        s16 = torch.where(e > 0, 2.0 ** (e.float() - 15), torch.zeros_like(e, dtype=torch.float32)).half()
    a = (dec.float() * s16.float()).half().float()
    return (x.half().float() @ a.t()) * g.column_factor


@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_arithmetic_matches_the_reference(fmt: str) -> None:
    torch.manual_seed(0)
    ts = [_quant(48, 256, fmt), _quant(32, 256, fmt, scale=0.3)]  # two global scales
    x = torch.randn(3, 256).bfloat16()
    assert _rel(_model(x, ts, fmt), _ref(x, ts, fmt)) < 2e-3


def test_reads_the_stored_tensors_in_place_with_column_factors() -> None:
    ts = [_quant(48, 256, "nvfp4"), _quant(16, 256, "nvfp4", scale=0.5)]
    g = Fp4Gemv("nvfp4", [m for t in ts for m in _members(t)])
    assert (g.n, g.k, g.n_sizes) == (64, 256, [48, 16])
    for t, w, sc in zip(ts, g.weights, g.scales, strict=True):  # no copy: the same storage
        assert w.data_ptr() == t["weight_packed"].data_ptr()
        assert sc.data_ptr() == t["weight_scale"].data_ptr()
    for rows, t in ((slice(0, 48), ts[0]), (slice(48, 64), ts[1])):
        want = 128.0 / t["weight_global_scale"].float()
        assert torch.allclose(g.column_factor[rows], want.expand(rows.stop - rows.start))
    assert g.nbytes() == 64 * 4  # only the column factors


def test_mxfp4_bias_maps_the_largest_scale_to_the_top_binade() -> None:
    t, t2 = _quant(32, 256, "mxfp4"), _quant(32, 256, "mxfp4", scale=0.001)
    g = Fp4Gemv("mxfp4", _members(t) + _members(t2))  # one bias: the larger scales'
    top = int(t["weight_scale"].view(torch.uint8).max())
    assert g.mx_bias == mx_bias(t["weight_scale"]) == top - 30 > mx_bias(t2["weight_scale"])
    nan = t["weight_scale"].clone()
    nan[0, 0] = 255  # an E8M0 NaN code does not set the offset
    assert mx_bias(nan) == top - 30
    g = Fp4Gemv("mxfp4", _members(t))
    assert torch.allclose(g.column_factor, torch.full((32,), 2.0 ** (top - 128)))


def test_bad_inputs_raise_before_any_work() -> None:
    t = _quant(32, 256, "nvfp4")
    with pytest.raises(ValueError, match="fmt"):
        Fp4Gemv("int4", _members(t))
    with pytest.raises(ValueError, match="multiple of 128"):
        Fp4Gemv("nvfp4", _members(_quant(32, 160, "nvfp4")))
    with pytest.raises(ValueError, match="share K"):
        Fp4Gemv("nvfp4", _members(t) + _members(_quant(32, 384, "nvfp4")))
    with pytest.raises(ValueError, match="1 to 3 weights"):
        Fp4Gemv("nvfp4", _members(t) * 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        Fp4Gemv("nvfp4", _members(_quant(24, 256, "nvfp4")) + _members(t))
    strided = dict(t, weight_packed=torch.zeros(32, 256, dtype=torch.uint8)[:, ::2])
    with pytest.raises(ValueError, match="contiguous"):
        Fp4Gemv("nvfp4", _members(strided))
    with pytest.raises(ValueError, match=r"weight_scale must be \[32, 16\]"):
        Fp4Gemv("nvfp4", _members(dict(t, weight_scale=t["weight_scale"][:, :8].contiguous())))
    with pytest.raises(ValueError, match="1-byte"):
        Fp4Gemv("nvfp4", _members(dict(t, weight_scale=t["weight_scale"].float())))
    with pytest.raises(ValueError, match="weight_global_scale"):
        Fp4Gemv("nvfp4", [(t["weight_packed"], t["weight_scale"], None)])
    offset = torch.zeros(32 * 128 + 1, dtype=torch.uint8)[1:].view(32, 128)
    with pytest.raises(ValueError, match="16-byte aligned"):
        Fp4Gemv("nvfp4", _members(dict(t, weight_packed=offset)))
    with pytest.raises(ValueError, match="variant"):
        Fp4Gemv("nvfp4", _members(t), variant=(32, 1, 0))
    with pytest.raises(ValueError, match="variant"):
        Fp4Gemv("nvfp4", _members(t), variant=(8, 1, 0, 3))
    for bad in ((8, 4, 2, 1), (8, 1), (8, 1, 0, 1, 1), (8, 1, 0, 2.0)):
        with pytest.raises(ValueError, match="variant must be ints"):
            Fp4Gemv("nvfp4", _members(t), variant=bad)
    assert Fp4Gemv("nvfp4", _members(t), variant=(4, 1, 0)).variant == (4, 1, 0, 1)
    for bad in (0, 17, 2.0, True):
        with pytest.raises(ValueError, match="split_k must be an int in 1..16"):
            Fp4Gemv("nvfp4", _members(t), split_k=bad)
    plain, split = Fp4Gemv("nvfp4", _members(t)), Fp4Gemv("nvfp4", _members(t), split_k=3)
    assert plain.split_k == 1 and plain.nbytes() == 32 * 4  # its column factors
    assert split.nbytes() == 32 * 4 + 32 * MAX_M * 4 + 2 * 4  # + [N, 8] sums, 2 tile counters
    g = Fp4Gemv("nvfp4", _members(t))
    with pytest.raises(ValueError, match="x must be bf16"):
        g(torch.zeros(MAX_M + 1, 256, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="x must be bf16"):
        g(torch.zeros(1, 256, dtype=torch.float16))
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    for out in (torch.zeros(2, 32), torch.zeros(1, 32, dtype=torch.bfloat16),
                torch.zeros(32, 2, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match="out must be bf16"):
            g(x, out=out)
    with pytest.raises(ValueError, match="sms must be a positive"):
        g(x, sms=0)


def test_variant_and_preference_by_shape() -> None:
    assert fp4_gemv.default_variant(37888, 3584) == (4, 1, 0, 2)  # many CTAs, two tiles each
    assert fp4_gemv.default_variant(4608, 3584) == (8, 2, 0, 1)  # 288 tiles
    assert fp4_gemv.default_variant(3584, 3584) == (8, 4, 0, 1)  # 224: two CTAs a multiprocessor
    assert fp4_gemv.default_variant(3584, 18944) == (4, 2, 0, 1)  # long K: split over 4 CTAs
    assert fp4_gemv.default_variant(37888, 18944) == (4, 1, 0, 2)  # long K, many tiles: unsplit
    assert fp4_gemv.default_variant(8192, 18944, sms=100) == (8, 1, 0, 1)
    assert fp4_gemv.default_variant(3584, 3584, sms=100) == (8, 2, 0, 1)
    assert fp4_gemv.preferred(4608, 3584) and not fp4_gemv.preferred(3584, 18944)
    assert fp4_gemv.preferred(3584, 18944, long_k=True)
    # K split over CTAs only where K is long and the tiles few (the 7B down projection)
    assert fp4_gemv.default_split_k(3584, 18944) == 4
    assert fp4_gemv.default_split_k(4608, 3584) == 1
    assert fp4_gemv.default_split_k(37888, 18944) == 1  # 2,368 tiles spread well without it
    # a variant whose staged activations would not fit 48 KiB takes fewer steps a batch
    assert fp4_gemv._fitting((16, 4, 1, 1), 8) == (16, 1, 1, 1)
    assert fp4_gemv._fitting((8, 2, 0, 2), 1) == (8, 2, 0, 2)
    assert fp4_gemv._fitting((8, 4, 1, 2), 8) == (8, 2, 1, 2)  # 8 * (2 * 8 * 256 + 1024) fits
    assert [fp4_gemv._mrows(m) for m in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]


def test_supports() -> None:
    assert supports("nvfp4", 3584, 1, torch.bfloat16)
    assert supports("mxfp4", 128, MAX_M, torch.bfloat16)
    assert not supports("nvfp4", 3584, MAX_M + 1, torch.bfloat16)
    assert not supports("nvfp4", 3584, 0, torch.bfloat16)
    assert not supports("nvfp4", 160, 1, torch.bfloat16)
    assert not supports("nvfp4", 3584, 1, torch.float16)
    assert not supports("nvfp4", 3584, 1, torch.bfloat16, torch.device("cpu"))


# -- the CUDA kernel -----------------------------------------------------------------------------

def _gpu_ok() -> bool:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    try:
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


gpu = pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU of sm_90+ and cuda-bindings")
TOL = 8e-3  # bf16 rounding of the output (and of the input) against a float32 reference


@gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("n,k,m", [(200, 128, 1), (200, 384, 3), (1000, 640, 8), (17, 256, 2),
                                   (48, 256, 5), (4608, 3584, 1), (3584, 18944, 1)])
@pytest.mark.parametrize("variant", [None, (4, 1, 0), (8, 4, 1), (16, 2, 0), (4, 1, 0, 2),
                                     (8, 2, 1, 2)])
def test_kernel_against_float32(fmt: str, n: int, k: int, m: int, variant) -> None:
    t = _quant(n, k, fmt, device="cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = Fp4Gemv(fmt, _members(t), variant=variant)(x)
    assert y.shape == (m, n) and torch.isfinite(y).all()
    assert _rel(y, _ref(x, [t], fmt)) < TOL


@gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("pdl,sms", [(False, None), (True, None), (True, 3)])
@pytest.mark.parametrize("variant", [None, (8, 2, 0, 2)])
def test_stacked_weights_into_a_strided_output(fmt: str, pdl: bool, sms, variant) -> None:
    """Three weights side by side (different global scales; the last not a whole tile), written
    into a view of a wider buffer; ``sms=3``: a grid of a few CTAs, each looping over tiles;
    two tiles a CTA: one pair of tiles straddles the second and third weights (at row 656)."""
    ts = [_quant(512, 3584, fmt, device="cuda"), _quant(144, 3584, fmt, device="cuda", scale=0.2),
          _quant(72, 3584, fmt, device="cuda", scale=0.005)]
    x = torch.randn(2, 3584, device="cuda", dtype=torch.bfloat16)
    big = torch.full((2, 800), 7.0, device="cuda", dtype=torch.bfloat16)
    y = Fp4Gemv(fmt, [m for t in ts for m in _members(t)], variant=variant)(
        x, out=big[:, 10:738], pdl=pdl, sms=sms)
    assert _rel(y, _ref(x, ts, fmt)) < TOL
    for i, (lo, hi) in enumerate(((0, 512), (512, 656), (656, 728))):  # each member on its own
        assert _rel(y[:, lo:hi], _ref(x, ts[i:i + 1], fmt)) < TOL, i
    assert (big[:, :10] == 7).all() and (big[:, 738:] == 7).all()  # nothing outside the view


@gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("split", [2, 3, 7])
@pytest.mark.parametrize("variant,sms", [((8, 4, 0, 1), None), ((4, 1, 0, 2), None),
                                         ((8, 2, 1, 1), 2)])
def test_split_k_against_float32(fmt: str, split: int, variant, sms) -> None:
    """K split over ``split`` CTAs a group of tiles (7 x 8 warps: more warps than the 20 steps
    of K, some with none), stacked weights (a pair of tiles straddling two), 1-8 rows, launched
    back to back with PDL (``sms=2``: a few CTAs looping over the items): every launch equals
    the reference, and the workspace and counters are zeros after them (the next launch's
    start)."""
    k = 2560
    ts = [_quant(208, k, fmt, device="cuda"), _quant(57, k, fmt, device="cuda", scale=0.1)]
    g = Fp4Gemv(fmt, [m for t in ts for m in _members(t)], variant=variant, split_k=split)
    for m in (1, 3, 8, 1):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = g(x, pdl=True, sms=sms)
        assert _rel(y, _ref(x, ts, fmt)) < TOL, m
        assert _rel(y[:, 208:], _ref(x, ts[1:], fmt)) < TOL, m
    torch.cuda.synchronize()
    sums, counters = g._split
    assert not sums.any() and not counters.any()
    assert all(key[-1] == 1 for key in g._functions)  # the split build ran every launch
    # the sums really meet in the workspace: a value left there joins feature 0's sum of row 0
    sums[0] = 1000.0
    y = g(x[:1].contiguous())
    want = _ref(x[:1], ts, fmt)
    want[0, 0] += 1000.0 * float(g.column_factor[0])
    assert _rel(y, want) < TOL and not sums.any()


@gpu
@pytest.mark.parametrize("variant,split", [(None, None), ((4, 1, 0, 2), None), (None, 3)])
def test_cuda_graph_replay_with_pdl_after_the_writer_of_x(variant, split) -> None:
    """Captured behind the kernels that write its input, launched with programmatic dependent
    launch: every replay reads the new input. (A torch writer lets it start only at its end; the
    engine's Triton writers let it start earlier, which
    ``test_gpu_gemv_rollout_matches_teacher_forcing`` covers.)"""
    t = _quant(640, 1024, "nvfp4", device="cuda")
    g = Fp4Gemv("nvfp4", _members(t), variant=variant, split_k=split)
    src = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(src)
    out = torch.empty(1, 640, device="cuda", dtype=torch.bfloat16)
    x.copy_(src)
    g(x, out=out, pdl=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.copy_(src)
        x.mul_(2.0)
        g(x, out=out, pdl=True)
        g(x, out=out, pdl=True)  # back to back with itself: the split's sums meet in one place
    for _ in range(3):
        src.copy_(torch.randn_like(src))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, _ref(src * 2.0, [t], "nvfp4")) < TOL


@gpu
def test_activations_beyond_float16_give_finite_outputs() -> None:
    """bf16 holds activations float16 cannot: the kernel saturates them (no inf, no NaN row);
    up to float16's range the result is as accurate as anywhere."""
    t = _quant(64, 256, "nvfp4", device="cuda")
    g = Fp4Gemv("nvfp4", _members(t))
    x = torch.randn(2, 256, device="cuda", dtype=torch.bfloat16)
    x[0, 3] = 6.0e4  # a massive activation, still within float16
    x[1, 5] = 3.0e5  # beyond it
    y = g(x)
    assert torch.isfinite(y).all()
    assert _rel(y[:1], _ref(x[:1], [t], "nvfp4")) < TOL
