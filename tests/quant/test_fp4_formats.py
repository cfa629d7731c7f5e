"""FP4 E2M1 codec, packing, NVFP4 / MXFP4 quantizers, and agreement with torchao.

torchao reference calls (torchao 0.18, CPU):

- NVFP4: ``NVFP4Tensor.to_nvfp4(w, block_size=16, per_tensor_scale=per_tensor_amax_to_scale(amax))``
  then ``.qdata`` (packed uint8, low nibble first), ``.scale`` (float8_e4m3fn [out, in/16]) and
  ``.dequantize(torch.float32)``. torchao's per-tensor scale is amax / (448 * 6), the reciprocal of
  compressed-tensors' stored global scale.
- MXFP4: ``MXTensor.to_mx(w, torch.float4_e2m1fn_x2, 32)`` (default FLOOR scaling) then
  ``.qdata``, ``.scale`` (E8M0 bits) and ``.dequantize(dtype)``.
"""

from __future__ import annotations

import pytest
import torch

from qerl.quant.formats import (
    E2M1_MAGNITUDES,
    FORMATS,
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    e8m0_to_float,
    get_format,
    pack_fp4,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_fp4,
)

torch.set_num_threads(1)

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * scale


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# --------------------------------------------------------------------------- E2M1


def test_e2m1_decode_table() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values[:8].tolist() == list(E2M1_MAGNITUDES)
    assert values[8:].tolist() == [-m for m in E2M1_MAGNITUDES]
    assert torch.signbit(values[8])  # code 8 is -0


def test_e2m1_round_trip_all_codes() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(e2m1_encode(e2m1_decode(codes)), codes)


@pytest.mark.parametrize(
    ("x", "expected"),
    [
        (0.25, 0.0),  # tie between codes 0|1 -> even code 0
        (0.75, 1.0),  # 1|2 -> 2
        (1.25, 1.0),  # 2|3 -> 2
        (1.75, 2.0),  # 3|4 -> 4
        (2.5, 2.0),  # 4|5 -> 4
        (3.5, 4.0),  # 5|6 -> 6
        (5.0, 4.0),  # 6|7 -> 6
        (0.2500001, 0.5),
        (0.7499999, 0.5),
        (5.0000005, 6.0),
        (6.9, 6.0),  # saturates
        (1e30, 6.0),
    ],
)
def test_e2m1_round_to_nearest_ties_to_even(x: float, expected: float) -> None:
    got = e2m1_decode(e2m1_encode(torch.tensor([x, -x])))
    assert got.tolist() == [expected, -expected]


def test_e2m1_matches_brute_force_nearest() -> None:
    x = _randn(20000, seed=1, scale=3.0)
    got = e2m1_decode(e2m1_encode(x))
    grid = torch.tensor(E2M1_MAGNITUDES)
    dist = (x.abs().clamp(max=6.0).unsqueeze(-1) - grid).abs()
    nearest = grid[dist.argmin(-1)] * torch.where(x < 0, -1.0, 1.0)
    assert torch.equal(got, nearest)


def test_e2m1_keeps_sign_of_values_rounding_to_zero() -> None:
    assert e2m1_encode(torch.tensor([-0.1, 0.1, -0.0])).tolist() == [8, 0, 8]


# --------------------------------------------------------------------------- packing


def test_pack_bytes_hand_computed() -> None:
    codes = torch.tensor([[1, 2, 15, 0, 8, 7], [0, 0, 3, 12, 10, 5]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    # element 2j -> low nibble, element 2j+1 -> high nibble
    assert packed.tolist() == [[0x21, 0x0F, 0x78], [0x00, 0xC3, 0x5A]]
    assert torch.equal(unpack_fp4(packed), codes)


def test_pack_rejects_odd_length() -> None:
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))


def test_nvfp4_bytes_hand_computed() -> None:
    # amax 6 -> global 448*6/6 = 448; block scale 6/6*448 = 448 (e4m3 0x7E); effective scale 1.
    row = [0.5, 1, 1.5, 2, 3, 4, 6, -0.5, 0, -1, -1.5, -2, -3, -4, -6, 0]
    q = quantize_nvfp4(torch.tensor([row]))
    assert q["weight_packed"].tolist() == [[0x21, 0x43, 0x65, 0x97, 0xA0, 0xCB, 0xED, 0x0F]]
    assert q["weight_scale"].dtype == torch.float8_e4m3fn
    assert _bits(q["weight_scale"]).tolist() == [0x7E]
    assert q["weight_global_scale"].dtype == torch.float32
    assert q["weight_global_scale"].tolist() == [448.0]
    assert dequantize_nvfp4(**q).tolist() == [[float(v) for v in row]]


def test_mxfp4_bytes_hand_computed() -> None:
    # block 0: amax 6 -> floor(log2 6) - 2 = 0 -> E8M0 127; block 1: amax 12 -> 1 -> 128.
    block0 = [6.0, -0.5] + [0.0] * 30
    block1 = [12.0, 3.0, -1.0] + [0.0] * 29
    q = quantize_mxfp4(torch.tensor([block0 + block1]))
    assert q["weight_scale"].dtype == torch.uint8
    assert q["weight_scale"].tolist() == [[127, 128]]
    packed = q["weight_packed"][0].tolist()
    assert packed[0] == 0x97  # 6 -> code 7 (low), -0.5 -> code 9 (high)
    assert packed[16] == 0x37  # 12/2 = 6 -> code 7 (low), 3/2 = 1.5 -> code 3 (high)
    assert packed[17] == 0x09  # -1/2 = -0.5 -> code 9 (low), 0 -> code 0 (high)
    assert dequantize_mxfp4(**q).tolist() == [block0 + block1]


def test_e8m0_decoding_is_exact() -> None:
    s = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    v = e8m0_to_float(s)
    assert v[:6].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(v[6])


# --------------------------------------------------------------------------- agreement with torchao


def _torchao_nvfp4(w: torch.Tensor):  # -> NVFP4Tensor
    mx = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    amax = w.float().abs().amax()
    return mx.NVFP4Tensor.to_nvfp4(
        w, block_size=16, per_tensor_scale=mx.per_tensor_amax_to_scale(amax)
    )


def _torchao_mxfp4(w: torch.Tensor):  # -> MXTensor
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    return mx.MXTensor.to_mx(w, torch.float4_e2m1fn_x2, 32)


def test_nvfp4_matches_torchao_exactly_with_power_of_two_global() -> None:
    # amax = 21 makes the global scale 448*6/21 = 128 (and torchao's per-tensor scale 1/128):
    # both implementations then do identical float math, so every bit must agree.
    w = _randn(128, 256, seed=2).clamp(-20, 20)
    w[5, 7] = -21.0
    ref = _torchao_nvfp4(w)
    q = quantize_nvfp4(w)
    assert q["weight_global_scale"].item() == 128.0
    assert torch.equal(ref.qdata.view(torch.uint8), q["weight_packed"])
    assert torch.equal(_bits(ref.scale), _bits(q["weight_scale"]))
    assert torch.equal(ref.dequantize(torch.float32), dequantize_nvfp4(**q))


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 50.0])
def test_nvfp4_matches_torchao_float32(magnitude: float) -> None:
    w = _randn(128, 256, seed=3, scale=magnitude)
    w[9, :48] = 0.0  # all-zero blocks
    ref = _torchao_nvfp4(w)
    q = quantize_nvfp4(w)
    assert torch.equal(ref.qdata.view(torch.uint8), q["weight_packed"])
    assert torch.equal(_bits(ref.scale), _bits(q["weight_scale"]))
    # torchao multiplies by amax/2688, we divide by 2688/amax: equal up to one float32 rounding.
    torch.testing.assert_close(
        dequantize_nvfp4(**q), ref.dequantize(torch.float32), rtol=3e-7, atol=0
    )


def test_nvfp4_bf16_agrees_with_torchao_up_to_scale_ties() -> None:
    # bf16 weights often put amax/6*global exactly on an E4M3 rounding tie; we compute the block
    # scale as amax/6 * global (compressed-tensors), torchao as (amax/6) / (amax_t/2688), so a tie
    # can round to the other neighbour. Both are valid; their quality must match.
    w = _randn(256, 512, seed=4, scale=10.0).to(torch.bfloat16)
    ref = _torchao_nvfp4(w)
    q = quantize_nvfp4(w)
    differing = (_bits(ref.scale) != _bits(q["weight_scale"])).float().mean().item()
    assert differing < 0.05
    w32 = w.float()
    err_ours = ((w32 - dequantize_nvfp4(**q)).norm() / w32.norm()).item()
    err_ref = ((w32 - ref.dequantize(torch.float32)).norm() / w32.norm()).item()
    assert abs(err_ours - err_ref) < 0.02 * err_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 1e4])
def test_mxfp4_matches_torchao_bit_exactly(dtype: torch.dtype, magnitude: float) -> None:
    w = _randn(64, 256, seed=5, scale=magnitude).to(dtype)
    w[3, :64] = 0.0  # all-zero blocks
    ref = _torchao_mxfp4(w)
    q = quantize_mxfp4(w)
    assert torch.equal(ref.qdata.view(torch.uint8), q["weight_packed"])
    assert torch.equal(ref.scale.view(torch.uint8), q["weight_scale"])
    for out_dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(ref.dequantize(out_dtype), dequantize_mxfp4(**q, dtype=out_dtype))


# --------------------------------------------------------------------------- properties


@pytest.mark.parametrize(("fmt", "bound"), [("nvfp4", 0.105), ("mxfp4", 0.125)])
def test_relative_error_bounds_on_gaussian_weights(fmt: str, bound: float) -> None:
    spec = get_format(fmt)
    w = _randn(512, 512, seed=6, scale=0.02)
    err = ((w - spec.dequantize(spec.quantize(w))).norm() / w.norm()).item()
    assert 0.05 < err < bound


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_zero_weight_and_dtypes(fmt: str) -> None:
    spec = get_format(fmt)
    zeros = spec.quantize(torch.zeros(4, 64))
    assert torch.equal(spec.dequantize(zeros), torch.zeros(4, 64))
    w = _randn(8, 64, seed=7)
    base = spec.quantize(w)
    for in_dtype in (torch.float16, torch.bfloat16, torch.float64):
        q = spec.quantize(w.to(in_dtype))
        assert set(q) == set(spec.tensor_names)
        for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert spec.dequantize(q, out_dtype).dtype == out_dtype
    assert torch.equal(
        _bits(spec.quantize(w.double())["weight_packed"]), _bits(base["weight_packed"])
    )


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_bad_inputs_are_refused(fmt: str) -> None:
    spec = get_format(fmt)
    with pytest.raises(ValueError, match="block size"):
        spec.quantize(torch.zeros(4, spec.block_size + 2))
    bad = torch.zeros(2, 64)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        spec.quantize(bad)
    with pytest.raises(TypeError):
        spec.quantize(torch.zeros(2, 64, dtype=torch.int32))


def test_registry_accounting() -> None:
    nv, mx = FORMATS["nvfp4"], FORMATS["mxfp4"]
    assert (nv.block_size, mx.block_size) == (16, 32)
    assert nv.tensor_names == ("weight_packed", "weight_scale", "weight_global_scale")
    assert mx.tensor_names == ("weight_packed", "weight_scale")
    assert nv.storage_bytes(64, 64) == 64 * 32 + 64 * 4 + 4
    assert nv.bits_per_weight(4096, 4096) == pytest.approx(4.5, abs=1e-5)
    assert mx.bits_per_weight(64, 64) == 4.25
    assert (nv.ct_format, mx.ct_format) == ("nvfp4-pack-quantized", "mxfp4-pack-quantized")
    with pytest.raises(KeyError, match="nvfp4"):
        get_format("int4")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_same_bits_on_every_device(fmt: str, device: str) -> None:
    spec = get_format(fmt)
    w = _randn(96, 128, seed=8).to(torch.bfloat16)
    cpu = spec.quantize(w)
    dev = spec.quantize(w.to(device))
    for name in spec.tensor_names:
        assert dev[name].device.type == device
        assert torch.equal(_bits(dev[name].cpu()), _bits(cpu[name]))
    assert torch.equal(
        spec.dequantize(dev, torch.bfloat16).cpu(), spec.dequantize(cpu, torch.bfloat16)
    )


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_chunked_quantization_is_bit_identical(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import qerl.quant.formats as formats

    spec = get_format(fmt)
    w = _randn(2, 37, 128, seed=9).to(torch.bfloat16)  # leading dims are flattened into rows
    whole = spec.quantize(w)
    monkeypatch.setattr(formats, "CHUNK_ELEMENTS", 3 * 128)  # 3 rows per chunk, ragged last one
    chunked = spec.quantize(w)
    for name in spec.tensor_names:
        assert chunked[name].shape == whole[name].shape
        assert torch.equal(_bits(chunked[name]), _bits(whole[name]))
