"""Where decode sends a group's LoRA when ``FastEngine(lora_kernel="gemv")`` (CPU, with a
stand-in for the FP4 GEMV that computes in torch what the CUDA kernel computes): inside the
GEMV's launch (the consumer's epilogue gets no LoRA output, no separate LoRA runs), back to a
separate LoRA when the GEMV's LoRA variant fails, and an error where the GEMV does not run the
group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qerl.rollout.fast import decode
from qerl.rollout.fast.gemm import GroupGemm
from qerl.rollout.fast.plan import build_plan, refresh_lora
from qerl.rollout.fast.torch_forward import TorchContext

from .test_fast_engine import _model


class _FakeGemv:
    """The GEMV's interface in torch: ``x W^T`` of the group's dequantized members, plus
    ``round(x a^T) b^T`` when given a LoRA (what ``fp4_gemv.cu`` computes); ``fail_lora``: the
    LoRA variant raises as a failed NVRTC compile would."""

    def __init__(self, group, fail_lora: bool = False) -> None:
        self.w = torch.cat([m.module.dequantize(torch.float32) for m in group.members])
        self.n_sizes = [m.out_f for m in group.members]
        self.n, self.k = self.w.shape
        self.device, self.variant = torch.device("cpu"), (8, 2, 0, 1)
        self.fail_lora, self.calls = fail_lora, []

    def __call__(self, x, pdl=False, sms=None, lora=None):
        self.calls.append(lora)
        if lora is not None and self.fail_lora:
            raise RuntimeError("fp4_gemv: NVRTC could not compile the kernel")
        y = x @ self.w.t()
        if lora is not None:
            state, a, b = lora
            assert state.ranks == [4, 4, 4] and state.check(self, a, b) == 8
            y = y + (x @ a.t()) @ b.t()
        return y


def _setup(fail_lora: bool = False):
    plan = build_plan(_model("qwen2", fmt="nvfp4", lora=True))
    refresh_lora(plan)
    g = plan.layers[0].qkv
    gm = GroupGemm(g, "torch", torch.float32)
    gm.gemv, gm.gemv_max_m = _FakeGemv(g, fail_lora), 1
    return g, gm


def _want(g, gm, x):
    return x @ gm.gemv.w.t() + (x @ g.a_cat.t()) @ g.b_full.t()


def test_decode_runs_the_lora_inside_the_gemv(monkeypatch) -> None:
    g, gm = _setup()
    # the real check wants bf16 CUDA tensors (the CPU plan's are float32)
    monkeypatch.setattr("qerl.kernels.fp4_gemv_lora.GemvLora.check",
                        lambda self, gemv, a, b: self.window)
    assert gm.lora_in_gemv(1) and not gm.lora_in_gemv(2)  # one row: the GEMV's
    st = SimpleNamespace(lora_in_gemv=True, pdl=False)  # no LoRA buffers: _lora would fail
    x = torch.randn(1, g.in_f)
    epis = decode._finished(st, TorchContext(gemms={id(g): gm}), "qkv", g, x, 1)
    assert [e.lora for e in epis] == [None, None, None]  # nothing left for the epilogue
    y = torch.cat([e.raw for e in epis], 1)
    assert torch.allclose(y, _want(g, gm, x), atol=1e-5)
    assert gm.gemv.calls[-1] is not None and gm._gemv_lora.split >= 1
    decode._finished(st, TorchContext(gemms={id(g): gm}), "qkv", g, x, 1)
    assert gm.gemv.calls[-1][0] is gm._gemv_lora  # one state for every launch


def test_a_failing_lora_variant_falls_back_loudly(monkeypatch) -> None:
    g, gm = _setup(fail_lora=True)
    monkeypatch.setattr("qerl.kernels.fp4_gemv_lora.GemvLora.check",
                        lambda self, gemv, a, b: self.window)
    x = torch.randn(1, g.in_f)
    with pytest.warns(UserWarning, match="cannot run inside its GEMV"):
        raws = gm.raw(x, lora=(g.a_cat, g.b_full))
    assert torch.allclose(torch.cat(raws, 1), _want(g, gm, x), atol=1e-5)  # this call: torch
    assert not gm.lora_in_gemv(1)  # later ones: the LoRA as its own launch
    st = SimpleNamespace(lora_in_gemv=True, pdl=False, gemm_sms=None)
    with pytest.raises(AttributeError, match="lora_out"):  # so decode takes the separate path
        decode._finished(st, TorchContext(gemms={id(g): gm}), "qkv", g, x, 1)


def test_raw_with_lora_where_the_gemv_does_not_run_raises() -> None:
    plan = build_plan(_model("qwen2", fmt="nvfp4", lora=True))
    refresh_lora(plan)
    g = plan.layers[0].qkv
    gm = GroupGemm(g, "torch", torch.float32)  # no GEMV off CUDA
    assert not gm.lora_in_gemv(1)
    with pytest.raises(ValueError, match="cannot run inside its GEMV at 1 rows"):
        gm.raw(torch.randn(1, g.in_f), lora=(g.a_cat, g.b_full))
