"""FP4 reference codec / matmul (CPU) and the Triton kernels against it (GPU only).

The CPU part checks the torch reference against independent implementations (the project's
``qerl.quant.formats`` when present, torchao's NVFP4/MX tensors when installed). The GPU part runs
the Triton kernels on fresh random inputs, odd shapes included, against dequantize-then-matmul in
float32, with the output poisoned beforehand so unwritten elements show up as NaN.
"""

from __future__ import annotations

import pytest
import torch

from qerl.kernels import fp4_matmul as fk

FORMATS = ("nvfp4", "mxfp4")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------ CPU: the codec


def test_e2m1_table_and_pack_roundtrip() -> None:
    table = fk.e2m1_table()
    assert table[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert (table[8:] == -table[:8]).all()
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    packed = fk.pack_e2m1(codes)
    assert packed.shape == (7, 32)
    # element 2j in the low nibble, 2j+1 in the high nibble
    assert (packed & 0xF).equal(codes[:, 0::2]) and (packed >> 4).equal(codes[:, 1::2])
    assert fk.unpack_e2m1_codes(packed).equal(codes)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_is_nearest_representable(fmt: str) -> None:
    torch.manual_seed(0)
    w = torch.randn(24, 128) * 0.05
    q = fk.quantize_fp4(w, fmt)
    deq = fk.dequantize_fp4(q["weight_packed"], q["weight_scale"], fmt, q.get("weight_global_scale"))
    assert deq.shape == w.shape
    assert _rel(deq, w) < 0.15
    # every element is the nearest of its block's representable values (E2M1 grid times the scale)
    g = fk.GROUP_SIZE[fmt]
    scale = fk.decode_scale(q["weight_scale"], fmt)
    if fmt == "nvfp4":
        scale = scale / q["weight_global_scale"]
    grid = fk.e2m1_table()[:8]
    cand = scale.repeat_interleave(g, dim=1).unsqueeze(-1) * grid  # [out, in, 8]
    best = (cand - w.abs().unsqueeze(-1)).abs().min(-1).values
    mags = (deq.abs().unsqueeze(-1) - w.abs().unsqueeze(-1)).abs().squeeze(-1)
    clipped = w.abs() > cand[..., -1]
    assert torch.all((mags <= best + 1e-7) | clipped)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_matches_project_formats(fmt: str) -> None:
    formats = pytest.importorskip("qerl.quant.formats")
    torch.manual_seed(1)
    w = torch.randn(40, 96 if fmt == "nvfp4" else 128)
    spec = formats.FORMATS[fmt]
    tensors = spec.quantize(w)
    ours = fk.dequantize_fp4(tensors["weight_packed"], tensors["weight_scale"], fmt,
                             tensors.get("weight_global_scale"))
    theirs = spec.dequantize(tensors, torch.float32)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_dequantize_matches_torchao_nvfp4() -> None:
    nv = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    torch.manual_seed(2)
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    amax = w.float().abs().max()
    t = nv.NVFP4Tensor.to_nvfp4(w, per_tensor_scale=amax / (448.0 * 6.0))
    packed = t.qdata.view(torch.uint8).reshape(32, 32)
    scale = t.scale.view(torch.float8_e4m3fn).reshape(32, 4)
    gscale = (1.0 / t.per_tensor_scale.float()).reshape(1)
    ours = fk.dequantize_fp4(packed, scale, "nvfp4", gscale)
    theirs = t.dequantize(torch.float32)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_dequantize_matches_torchao_mxfp4() -> None:
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    torch.manual_seed(3)
    w = torch.randn(16, 64, dtype=torch.bfloat16)
    scale_e8m0, data = mx.to_mx(w, torch.float4_e2m1fn_x2, 32)
    packed = data.view(torch.uint8).reshape(16, 32)
    ours = fk.dequantize_fp4(packed, scale_e8m0.view(torch.uint8).reshape(16, 2), "mxfp4")
    theirs = mx.to_dtype(data, scale_e8m0, torch.float4_e2m1fn_x2, 32, torch.float32)
    torch.testing.assert_close(ours, theirs.reshape(16, 64), rtol=0, atol=0)


def test_permutation_roundtrip_and_reference_layouts() -> None:
    torch.manual_seed(4)
    x = torch.randn(3, 5, 64)
    xp = fk.permute_activation(x)
    assert torch.equal(fk.unpermute_activation(xp), x)
    k = 13
    assert xp[..., (k % 8) * 8 + k // 8].equal(x[..., k])
    q = fk.quantize_fp4(torch.randn(24, 64), "nvfp4")
    args = (q["weight_packed"], q["weight_scale"], "nvfp4", q["weight_global_scale"])
    x2 = torch.randn(7, 64)
    y = fk.fp4_linear_reference(x2, *args)
    yp = fk.fp4_linear_reference(fk.permute_activation(x2), *args, x_permuted=True,
                                 out_permuted=True)
    torch.testing.assert_close(fk.unpermute_activation(yp), y)


def test_fp4_linear_cpu_dispatch_with_lora_and_gate_up() -> None:
    torch.manual_seed(5)
    K, N, M, r = 64, 32, 4, 3
    q1 = fk.quantize_fp4(torch.randn(N, K), "mxfp4")
    q2 = fk.quantize_fp4(torch.randn(N, K), "mxfp4")
    x = torch.randn(M, K)
    xa = torch.randn(M, 2 * r)
    b1, b2 = torch.randn(N, r), torch.randn(N, r)
    y = fk.fp4_linear(x, q1["weight_packed"], q1["weight_scale"], "mxfp4", lora_xa=xa[:, :r],
                      lora_b=b1, gate_up={"packed": q2["weight_packed"], "scale": q2["weight_scale"],
                                          "lora_xa": xa[:, r:], "lora_b": b2})
    w1 = fk.dequantize_fp4(q1["weight_packed"], q1["weight_scale"], "mxfp4")
    w2 = fk.dequantize_fp4(q2["weight_packed"], q2["weight_scale"], "mxfp4")
    g = x @ w1.t() + xa[:, :r] @ b1.t()
    u = x @ w2.t() + xa[:, r:] @ b2.t()
    torch.testing.assert_close(y, torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ GPU: the kernels

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and fk.HAS_TRITON),
                         reason="needs a CUDA GPU and Triton")

SHAPES = [(1, 96, 256), (3, 200, 160), (16, 512, 3584), (33, 1000, 544), (64, 3584, 3584),
          (256, 136, 1024), (1000, 384, 768)]


def _case(fmt, M, N, K, device="cuda", dtype=torch.bfloat16):
    w = torch.randn(N, K, device=device) * (0.02 + torch.rand(N, 1, device=device))
    q = fk.quantize_fp4(w, fmt)
    x = torch.randn(M, K, device=device).to(dtype)
    return q, x


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("perm", [False])
def test_kernel_matches_reference(fmt, M, N, K, perm) -> None:
    if K % fk.GROUP_SIZE[fmt]:
        pytest.skip("K not a multiple of the group")
    torch.manual_seed(hash((fmt, M, N, K, perm)) % 2**31)
    q, x = _case(fmt, M, N, K)
    args = (q["weight_packed"], q["weight_scale"], fmt, q.get("weight_global_scale"))
    ref = fk.fp4_linear_reference(x, *args, out_dtype=torch.float32)
    xin = fk.permute_activation(x) if perm else x
    configs = [None, fk.SAFE_CONFIG]
    for asm in ((True, False) if M in (3, 64) else (True,)):
        for cfg in configs:
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            y = fk.fp4_linear_triton(xin, *args, x_permuted=perm, out=out, use_asm=asm, config=cfg)
            assert not torch.isnan(y).any(), "unwritten output"
            assert _rel(y, ref) < 8e-3, (asm, cfg, _rel(y, ref))


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M,N,K", [(1, 96, 256), (37, 264, 1024), (64, 3584, 3584)])
@pytest.mark.parametrize("swap", [False, True])
def test_kernel_permuted_activations(fmt, M, N, K, swap) -> None:
    torch.manual_seed(M + N)
    q, x = _case(fmt, M, N, K)
    args = (q["weight_packed"], q["weight_scale"], fmt, q.get("weight_global_scale"))
    ref = fk.fp4_linear_reference(x, *args, out_dtype=torch.float32)
    cfg = fk.Fp4Config(BM=16 if M < 32 else 64, BN=64, BKW=16, SPLIT_K=2, SWAP=swap)
    y = fk.fp4_linear_triton(fk.permute_activation(x), *args, x_permuted=True, config=cfg)
    assert _rel(y, ref) < 8e-3


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("split", [1, 4])
def test_kernel_epilogue_lora_bias_gate_up_split(fmt, split) -> None:
    torch.manual_seed(7 + split)
    M, N, K, r = 37, 264, 1024, 32
    q1, x = _case(fmt, M, N, K)
    q2, _ = _case(fmt, M, N, K)
    xa = torch.randn(M, 2 * r, device="cuda").to(torch.bfloat16)
    lb1 = (torch.randn(N, r, device="cuda") * 0.1).to(torch.bfloat16)
    lb2 = (torch.randn(N, r, device="cuda") * 0.1).to(torch.bfloat16)
    b1 = torch.randn(N, device="cuda").to(torch.bfloat16)
    b2 = torch.randn(N, device="cuda").to(torch.bfloat16)
    gu = {"packed": q2["weight_packed"], "scale": q2["weight_scale"],
          "global_scale": q2.get("weight_global_scale"), "bias": b2, "lora_xa": xa[:, r:],
          "lora_b": lb2}
    args = (q1["weight_packed"], q1["weight_scale"], fmt, q1.get("weight_global_scale"), b1)
    kw = dict(lora_xa=xa[:, :r], lora_b=lb1, gate_up=gu, out_permuted=True)
    ref = fk.fp4_linear_reference(x, *args, **kw, out_dtype=torch.bfloat16)
    cfg = fk.Fp4Config(BM=64, BN=64, BKW=16, SPLIT_K=split, SWAP=True)
    for _ in range(2):  # the split-K workspace must be left zeroed by the first call
        y = fk.fp4_linear_triton(x, *args, **kw, config=cfg)
        assert _rel(y, ref) < 2e-2
    y1 = fk.fp4_linear_triton(x, *args[:4], config=cfg)
    ref1 = fk.fp4_linear_reference(x, *args[:4], out_dtype=torch.float32)
    assert _rel(y1, ref1) < 8e-3


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_kernel(fmt) -> None:
    torch.manual_seed(11)
    q, _ = _case(fmt, 1, 300, 1056 if fmt == "nvfp4" else 1088)
    args = (q["weight_packed"], q["weight_scale"], fmt, q.get("weight_global_scale"))
    ref = fk.dequantize_fp4(*args)
    for asm in (True, False):
        w = fk.fp4_dequantize_triton(*args, use_asm=asm)
        assert _rel(w, ref) < 4e-3


def test_load_tuning_overrides_pick_config(tmp_path, monkeypatch) -> None:
    """A tile table from the benchmark's --tuning-out replaces the built-in entry it names."""
    monkeypatch.setattr(fk, "CONFIG_TABLE", dict(fk.CONFIG_TABLE))
    before = fk.pick_config(64, 3584, 3584)
    before_silu = fk.pick_config(64, 18944, 3584, silu=True)
    f = tmp_path / "tuning.json"
    f.write_text('{"64,false": {"SWAP": true, "BM": 64, "BN": 128, "BKW": 32, "num_warps": 8, '
                 '"num_stages": 3, "programs": 56}}')
    fk.load_tuning(f)
    cfg = fk.pick_config(64, 3584, 3584)
    assert (cfg.BN, cfg.BKW, cfg.num_warps, cfg.num_stages) == (128, 32, 8, 3)
    assert (cfg.BN, cfg.BKW) != (before.BN, before.BKW)
    # split-K aims at the table's program count: 28 tiles of 128 rows -> 2 splits for 56 programs
    # (the default of 2 programs per SM would give 4)
    assert cfg.SPLIT_K == 2
    assert fk.pick_config(64, 18944, 3584, silu=True) == before_silu  # entry not named: kept


@pytest.mark.parametrize("text,match", [
    ('{"sixty-four,False": {"BM": 64}}', "sixty-four"),
    ('{"65,False": {"BM": 64}}', "65,False"),
    ('{"64,yes": {"BM": 64}}', "64,yes"),
    ('{"64,False": {"num_warp": 4}}', "num_warp"),
    ('{"64,False": {"BKW": 0}}', "BKW=0"),
    ('{"64,False": [64]}', "not an object"),
    ('[{"BM": 64}]', "JSON object"),
])
def test_load_tuning_refuses_bad_tables_whole(tmp_path, monkeypatch, text, match) -> None:
    """A bad tile table names the key or field and changes nothing (not even its good entries)."""
    monkeypatch.setattr(fk, "CONFIG_TABLE", dict(fk.CONFIG_TABLE))
    table = dict(fk.CONFIG_TABLE)
    f = tmp_path / "bad.json"
    if text.startswith("{"):
        text = '{"16,True": {"BM": 16}, ' + text[1:]
    f.write_text(text)
    with pytest.raises(ValueError, match=match):
        fk.load_tuning(f)
    assert fk.CONFIG_TABLE == table


@gpu
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("M", [9, 32, 50, 128, 200])
def test_kernel_default_tiles_every_bucket(fmt, M) -> None:
    """The built-in tile table (every M bucket, plain and fused gate/up + LoRA) is exact."""
    torch.manual_seed(100 + M)
    N, K, r = 1000, 1024, 16
    q1, x = _case(fmt, M, N, K)
    q2, _ = _case(fmt, M, N, K)
    args = (q1["weight_packed"], q1["weight_scale"], fmt, q1.get("weight_global_scale"))
    ref = fk.fp4_linear_reference(x, *args, out_dtype=torch.float32)
    failed = len(fk._FAILED_CONFIGS)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    fk.fp4_linear_triton(x, *args, out=out)
    assert not torch.isnan(out).any() and _rel(out, ref) < 8e-3, _rel(out, ref)
    xa = torch.randn(M, 2 * r, device="cuda").to(torch.bfloat16)
    lb = [(torch.randn(N, r, device="cuda") * 0.1).to(torch.bfloat16) for _ in range(2)]
    gu = {"packed": q2["weight_packed"], "scale": q2["weight_scale"],
          "global_scale": q2.get("weight_global_scale"), "lora_xa": xa[:, r:], "lora_b": lb[1]}
    kw = dict(lora_xa=xa[:, :r], lora_b=lb[0], gate_up=gu)
    ref2 = fk.fp4_linear_reference(x, *args, **kw, out_dtype=torch.bfloat16)
    y2 = fk.fp4_linear_triton(x, *args, **kw)
    assert _rel(y2, ref2) < 2e-2, _rel(y2, ref2)
    assert len(fk._FAILED_CONFIGS) == failed, "a built-in tile config failed to compile"
