"""Backend selection, the dequantize paths and the memory-lean autograd function (CPU).

The autograd function is checked against plain autograd through ``F.linear`` on the dequantized
weight (values, x-gradient, bias gradient), and for what it saves (nothing but a reference to the
layer). The Triton dequantize kernel is checked against the torch codec when Triton is installed
(on CPU under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qerl.errors import QerlConfigError
from qerl.kernels import (
    FP4_BACKENDS,
    Fp4LinearFunction,
    KernelCache,
    available_backends,
    dequant,
    dequantize_into,
    fp4_linear,
    humming_max_m,
    resolve_backend,
    scratch,
    use_backend,
)
from qerl.kernels import backend as kb
from qerl.quant.formats import FORMATS
from qerl.quant.linear import QuantLinear, reference_fp4_matmul

FMTS = sorted(FORMATS)


@pytest.fixture(autouse=True)
def _restore_backend(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(kb.ENV_VAR, raising=False)
    previous = kb._chosen
    yield
    kb._chosen = previous


def _layer(fmt: str, bias: bool = True, in_f: int = 64, out_f: int = 48) -> QuantLinear:
    torch.manual_seed(0)
    return QuantLinear.from_linear(nn.Linear(in_f, out_f, bias=bias), fmt)


# ------------------------------------------------------------------ backend selection


def test_torch_is_always_available_and_auto_resolves_to_an_available_backend() -> None:
    assert "torch" in available_backends()
    assert set(available_backends()) <= set(FP4_BACKENDS)
    assert resolve_backend() == available_backends()[0]
    if not torch.cuda.is_available():
        assert resolve_backend() == "torch"


def test_precedence_explicit_then_use_backend_then_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kb, "backend_available", lambda name: name in ("torch", "triton"))
    monkeypatch.setattr(kb, "available_backends", lambda: ["triton", "torch"])
    assert resolve_backend() == "triton"
    monkeypatch.setenv(kb.ENV_VAR, "torch")
    assert resolve_backend() == "torch"
    assert use_backend("triton") == "auto"
    assert resolve_backend() == "triton"  # the setting wins over the environment
    assert resolve_backend("torch") == "torch"  # an explicit name wins over both
    assert use_backend("auto") == "triton"
    assert resolve_backend() == "torch"


def test_unknown_or_unavailable_backends_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kb, "backend_available", lambda name: name == "torch")
    monkeypatch.setattr(kb, "available_backends", lambda: ["torch"])
    with pytest.raises(QerlConfigError) as info:
        use_backend("cutlass")
    assert info.value.field == "quant.backend" and "humming" in info.value.fix
    with pytest.raises(QerlConfigError) as info:
        use_backend("humming")
    assert info.value.field == "quant.backend" and "gpu" in info.value.problem
    assert kb._chosen == "auto"  # nothing changed
    monkeypatch.setenv(kb.ENV_VAR, "triton")
    with pytest.raises(QerlConfigError) as info:
        resolve_backend()
    assert info.value.field == kb.ENV_VAR and "torch" in info.value.fix


def test_humming_max_m_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert humming_max_m() == kb.HUMMING_MAX_M
    monkeypatch.setenv(kb.MAX_M_ENV_VAR, "96")
    assert humming_max_m() == 96
    monkeypatch.setenv(kb.MAX_M_ENV_VAR, "lots")
    with pytest.raises(QerlConfigError, match=kb.MAX_M_ENV_VAR):
        humming_max_m()


# ------------------------------------------------------------------ dequantize paths


@pytest.mark.parametrize("fmt", FMTS)
def test_torch_dequantize_into_slices_equals_codec(fmt: str) -> None:
    lay = _layer(fmt)
    buf = torch.full((100, 64), float("nan"))
    dequantize_into(buf[10:58], fmt, *_tensors(lay), impl="torch")
    assert torch.equal(buf[10:58], lay.dequantize(torch.float32))
    assert torch.isnan(buf[:10]).all() and torch.isnan(buf[58:]).all()
    with pytest.raises(ValueError, match="does not fit"):
        dequantize_into(torch.empty(48, 32), fmt, *_tensors(lay), impl="torch")


def _tensors(lay: QuantLinear):
    return lay.weight_packed, lay.weight_scale, getattr(lay, "weight_global_scale", None)


@pytest.mark.skipif(not dequant.HAS_TRITON or (not torch.cuda.is_available()
                                               and os.environ.get("TRITON_INTERPRET") != "1"),
                    reason="needs Triton on CUDA, or TRITON_INTERPRET=1")
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_dequantize_equals_codec(fmt: str) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for n, k in [(33, 160), (64, 512), (7, 96)]:
        if k % FORMATS[fmt].block_size:
            continue
        w = torch.randn(n, k, device=dev) * 0.3
        w[0, :32] = 0.0
        t = FORMATS[fmt].quantize(w)
        out = torch.full((n, k), float("nan"), device=dev)
        dequantize_into(out, fmt, t["weight_packed"], t["weight_scale"],
                        t.get("weight_global_scale"), impl="triton")
        assert torch.equal(out, FORMATS[fmt].dequantize(t, torch.float32))


def test_scratch_grows_and_is_shared() -> None:
    a = scratch(torch.device("cpu"), torch.float16, 4, 8)
    b = scratch(torch.device("cpu"), torch.float16, 2, 8)
    assert a.shape == (4, 8) and b.shape == (2, 8) and a.data_ptr() == b.data_ptr()
    c = scratch(torch.device("cpu"), torch.float16, 64, 64)
    assert c.shape == (64, 64) and c.numel() >= 4096


# ------------------------------------------------------------------ autograd function


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("bias_grad", [False, True])
def test_autograd_function_matches_plain_autograd(fmt: str, bias_grad: bool) -> None:
    lay = _layer(fmt)
    lay.bias.requires_grad_(bias_grad)
    x = torch.randn(3, 5, 64, requires_grad=True)
    y = fp4_linear(x, lay)
    g = torch.randn_like(y)
    y.backward(g)
    x_ref = x.detach().clone().requires_grad_(True)
    b_ref = lay.bias.detach().clone().requires_grad_(bias_grad)
    y_ref = F.linear(x_ref, lay.dequantize(torch.float32), b_ref)
    y_ref.backward(g)
    assert torch.equal(y, y_ref)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    if bias_grad:
        torch.testing.assert_close(lay.bias.grad, b_ref.grad, rtol=1e-6, atol=1e-6)
    assert torch.equal(y, reference_fp4_matmul(x, lay))


def test_autograd_saves_no_tensor() -> None:
    """Backward keeps nothing alive: not x, not the dequantized [out, in] weight."""
    lay = _layer("nvfp4")
    x = torch.randn(4, 64, requires_grad=True)
    saved: list[torch.Size] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        y = Fp4LinearFunction.apply(x, lay.bias, lay)
    assert saved == []
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t,
                                                  lambda t: t):
        F.linear(x, lay.dequantize(torch.float32), lay.bias)
    assert any(s.numel() == 48 * 64 for s in saved)  # plain autograd keeps the weight


def test_checkpointed_layers_backward() -> None:
    from torch.utils.checkpoint import checkpoint

    layers = [_layer("mxfp4", in_f=64, out_f=64) for _ in range(3)]
    x = torch.randn(8, 64, requires_grad=True)

    def run(h):
        for lay in layers:
            h = torch.relu(fp4_linear(h, lay))
        return h

    checkpoint(run, x, use_reentrant=False).sum().backward()
    x2 = x.detach().clone().requires_grad_(True)
    h = x2
    for lay in layers:
        h = torch.relu(F.linear(h, lay.dequantize(torch.float32), lay.bias))
    h.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


def test_autocast_casts_the_input() -> None:
    lay = _layer("nvfp4")
    x = torch.randn(2, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lay(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, F.linear(x.bfloat16(), lay.dequantize(torch.bfloat16),
                                   lay.bias.bfloat16()))


# ------------------------------------------------------------------ kernel cache


def test_kernel_cache_rebuilds_on_change_and_is_not_copied() -> None:
    cache, built = KernelCache(), []

    def build():
        built.append(1)
        return object()

    a = cache.get("k", (1,), build)
    assert cache.get("k", (1,), build) is a and len(built) == 1
    b = cache.get("k", (2,), build)
    assert b is not a and len(built) == 2 and len(cache) == 1
    assert len(copy.deepcopy(cache)) == 0
    lay = _layer("nvfp4")
    lay.kernel_cache.get("x", (0,), build)
    assert len(copy.deepcopy(lay).kernel_cache) == 0
