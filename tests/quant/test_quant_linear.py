"""QuantLinear: storage layout, forward/backward, dtype safety, model helpers (the kernel
dispatch and the autograd function are tested in tests/kernels)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qerl.errors import QerlConfigError
from qerl.quant.formats import FORMATS
from qerl.quant.linear import QuantLinear, module_matches, quantize_model_
from qerl.quant.report import quant_report

torch.set_num_threads(1)

FMTS = sorted(FORMATS)


def _linear(in_f: int = 64, out_f: int = 48, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


class Toy(nn.Module):
    """Two blocks of projections plus an lm_head; ``odd`` has 40 inputs (no block size divides)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64, bias=False)
        self.odd = nn.Linear(40, 64)
        self.norm = nn.LayerNorm(64)
        self.lm_head = nn.Linear(64, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.down(F.relu(self.up(x)))))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_is_compressed_tensors_layout(fmt: str, bias: bool) -> None:
    layer = QuantLinear.from_linear(_linear(bias=bias), fmt)
    sd = layer.state_dict()
    expected = set(FORMATS[fmt].tensor_names) | ({"bias"} if bias else set())
    assert set(sd) == expected
    assert sd["weight_packed"].dtype == torch.uint8 and sd["weight_packed"].shape == (48, 32)
    assert sd["weight_scale"].dtype == FORMATS[fmt].scale_dtype
    assert sd["weight_scale"].shape == (48, 64 // FORMATS[fmt].block_size)
    if fmt == "nvfp4":
        assert sd["weight_global_scale"].dtype == torch.float32 and sd[
            "weight_global_scale"
        ].shape == (1,)
    assert layer.weight is None and layer.qweight is layer.weight_packed
    assert (layer.in_features, layer.out_features, layer.fmt) == (64, 48, fmt)
    assert not any(p.requires_grad for p in layer.parameters())


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_is_dequantize_then_linear(fmt: str, dtype: torch.dtype) -> None:
    lin = _linear()
    layer = QuantLinear.from_linear(lin, fmt)
    x = torch.randn(3, 5, 64).to(dtype)
    y = layer(x)
    assert y.dtype == dtype
    expected = F.linear(x, layer.dequantize(dtype), lin.bias.detach().to(dtype))
    assert torch.equal(y, expected)
    rel = ((y.float() - lin(x.float())).norm() / lin(x.float()).norm()).item()
    assert rel < 0.2


@pytest.mark.parametrize("fmt", FMTS)
def test_backward_reaches_input_only(fmt: str) -> None:
    layer = QuantLinear.from_linear(_linear(), fmt)
    x = torch.randn(4, 64, requires_grad=True)
    layer(x).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert all(p.grad is None for p in layer.parameters())


@pytest.mark.parametrize("fmt", FMTS)
def test_dtype_casts_never_touch_quantized_buffers(fmt: str) -> None:
    layer = QuantLinear.from_linear(_linear(), fmt)
    before = {k: v.clone() for k, v in layer.quantized_tensors().items()}
    for cast in (
        lambda m: m.to(torch.bfloat16),
        lambda m: m.half(),
        lambda m: m.double(),
        lambda m: m.float(),
    ):
        cast(layer)
        for name, t in layer.quantized_tensors().items():
            assert t.dtype == before[name].dtype
            assert torch.equal(_bits(t), _bits(before[name]))
    assert layer.bias.dtype == torch.float32
    layer.to(torch.bfloat16)
    assert layer.bias.dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", FMTS)
def test_quantized_buffers_are_never_views(fmt: str) -> None:
    """No buffer is a view after quantization or a cast, so swapping a buffer's storage (the rollout
    engine's host parking) releases the old storage instead of a hidden base keeping it."""
    layer = QuantLinear.from_linear(_linear(), fmt)
    for step in (lambda m: m, lambda m: m.to(torch.bfloat16), lambda m: m.half()):
        step(layer)
        assert all(t._base is None for t in layer.quantized_tensors().values())
    t = layer.weight_packed
    ref = t.clone()
    t.data = t.data.clone()  # the storage swap; the tensor object stays the layer's buffer
    assert layer.weight_packed is t and torch.equal(layer.weight_packed, ref)


def test_module_matches_dotted_patterns() -> None:
    assert module_matches("lm_head", ["lm_head"])
    assert module_matches("model.layers.3.mlp.down_proj", ["mlp.down_proj"])
    assert module_matches("model.layers.0.self_attn.q_proj", ["layers.0"])
    assert not module_matches("model.layers.10.mlp.up_proj", ["layers.1"])
    assert not module_matches("model.lm_head_extra", ["lm_head"])


@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_model_skips_and_warns(fmt: str) -> None:
    model = Toy()
    x = torch.randn(2, 64)
    with pytest.warns(UserWarning, match="odd"):
        summary = quantize_model_(model, fmt)
    assert summary.quantized == ["up", "down"]
    assert set(summary.skipped) == {"odd", "lm_head"}
    assert isinstance(model.up, QuantLinear) and isinstance(model.down, QuantLinear)
    assert type(model.odd) is nn.Linear and type(model.lm_head) is nn.Linear
    assert model(x).shape == (2, 32)


def test_quantize_model_error_names_layer_and_fix() -> None:
    model = Toy()
    with pytest.raises(QerlConfigError) as info:
        quantize_model_(model, "mxfp4", on_indivisible="error")
    err = info.value
    assert err.field == "quant.on_indivisible"
    assert "'odd'" in err.problem and "40" in err.problem and "32" in err.problem
    assert "skip" in err.fix
    assert type(model.up) is nn.Linear  # nothing was changed before the check failed


def test_quantize_model_bad_settings() -> None:
    with pytest.raises(QerlConfigError, match="quant.format"):
        quantize_model_(Toy(), "int3")
    with pytest.raises(QerlConfigError, match="quant.on_indivisible"):
        quantize_model_(Toy(), "nvfp4", on_indivisible="ignore")  # type: ignore[arg-type]


def test_quantize_model_custom_skip_and_device() -> None:
    model = Toy()
    summary = quantize_model_(model, "nvfp4", skip_modules=("lm_head", "down", "odd"), device="cpu")
    assert summary.quantized == ["up"]
    assert model.up.weight_packed.device.type == "cpu"


def test_quant_report_rows() -> None:
    model = Toy()
    ref = {
        n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)
    }
    with pytest.warns(UserWarning):
        quantize_model_(model, "nvfp4")
    model.lm_head.to(torch.bfloat16)
    rows = {r["name"]: r for r in quant_report(model, ref)}
    assert set(rows) == {"up", "down", "odd", "lm_head"}
    up = rows["up"]
    assert up["format"] == "nvfp4" and up["shape"] == [128, 64] and up["n_params"] == 128 * 64
    assert up["weight_bytes"] == 128 * 32 + 128 * 4 + 4
    assert up["bits_per_weight"] == pytest.approx(8 * up["weight_bytes"] / (128 * 64))
    assert 0.05 < up["rel_error"] < 0.12
    assert rows["odd"]["format"] == "fp32" and rows["odd"]["bits_per_weight"] == 32.0
    assert rows["odd"]["rel_error"] == 0.0
    assert rows["lm_head"]["format"] == "bf16" and rows["lm_head"]["bits_per_weight"] == 16.0
    no_ref = {r["name"]: r for r in quant_report(model)}
    assert no_ref["up"]["rel_error"] is None and no_ref["odd"]["rel_error"] == 0.0
    assert [r["name"] for r in quant_report({"x": model.up})] == ["x"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_layer_by_layer_onto_cuda(fmt: str) -> None:
    model = Toy()
    x = torch.randn(2, 64)
    with pytest.warns(UserWarning):
        quantize_model_(model, fmt, device="cuda")
    assert (
        model.up.weight_packed.is_cuda and not model.norm.weight.is_cuda
    )  # only quantized layers moved
    model.to("cuda")
    cpu_model = Toy()
    with pytest.warns(UserWarning):
        quantize_model_(cpu_model, fmt)
    cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    torch.testing.assert_close(model(x.cuda()).cpu(), cpu_model(x), rtol=1e-4, atol=1e-5)
