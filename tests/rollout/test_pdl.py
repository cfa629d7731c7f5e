"""When the fast engine launches its decode kernels with programmatic dependent launch (PDL):
the resolution of ``pdl`` from the device, the Triton build and ``QERL_PDL``, and the launch
options each launcher passes. (That PDL leaves the rollout unchanged is a GPU test in
test_fast_engine.py.)"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

from qerl.rollout.fast import pdl as K
from qerl.rollout.fast.options import resolve_pdl

CUDA = torch.device("cuda", 0)


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch):
    """A compiled Triton whose launcher takes ``launch_pdl`` on a compute capability 9.0 GPU
    (faked: the CPU machine has neither); returns a setter for the capability and the options."""
    @dataclasses.dataclass
    class CUDAOptions:
        num_warps: int = 4
        launch_pdl: bool = False

    mod = types.ModuleType("triton.backends.nvidia.compiler")
    mod.CUDAOptions = CUDAOptions
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.compiler", mod)
    monkeypatch.setattr(K, "HAS_TRITON", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("QERL_PDL", raising=False)
    cap = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["value"])

    def set_(capability=(9, 0), options=CUDAOptions):
        cap["value"] = capability
        mod.CUDAOptions = options

    return set_


def test_pdl_on_hopper_with_a_launcher_that_takes_it(hopper) -> None:
    assert K.pdl_supported(CUDA)
    assert resolve_pdl(None, CUDA) is True and resolve_pdl(True, CUDA) is True
    assert resolve_pdl(False, CUDA) is False


@pytest.mark.parametrize("why", ["ampere", "old_triton", "env_off", "interpreter", "cpu"])
def test_pdl_off_where_it_cannot_or_should_not_run(hopper, monkeypatch, why) -> None:
    device = CUDA
    if why == "ampere":
        hopper(capability=(8, 0))
    elif why == "old_triton":
        @dataclasses.dataclass
        class Old:
            num_warps: int = 4

        hopper(options=Old)
    elif why == "env_off":
        monkeypatch.setenv("QERL_PDL", "0")
    elif why == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        device = torch.device("cpu")
    assert not K.pdl_supported(device)
    assert resolve_pdl(None, device) is False and resolve_pdl(False, device) is False
    with pytest.raises(ValueError, match="pdl=True needs a CUDA GPU of compute capability 9.0"):
        resolve_pdl(True, device)


def test_pdl_value_must_be_a_bool_or_none() -> None:
    for bad in ("on", 1, 0.0):
        with pytest.raises(ValueError, match="pdl must be True, False or None"):
            resolve_pdl(bad, torch.device("cpu"))


def test_launch_options_name_the_kernel_flag_and_the_launch_attribute() -> None:
    """With PDL the kernel waits for its predecessor (``PDL``) and is launched with the
    programmatic-serialization attribute (``launch_pdl``); without, neither."""
    assert K.launch_kw(True) == {"PDL": True, "launch_pdl": True}
    assert K.launch_kw(False) == {"PDL": False}


def test_lora_runs_beside_the_gemm_only_with_pdl_and_the_fused_kernel_on_the_main_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``FastEngine(lora_sms=N)``: humming's GEMMs get all but N multiprocessors only where the
    fused LoRA can run beside them (PDL on, the fused kernel, no side stream)."""
    from types import SimpleNamespace

    from qerl.rollout.fast.options import beside_gemm_sms

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=132))
    ok = dict(pdl=True, lora_fused={"qkv": ()}, side=None)
    assert beside_gemm_sms(SimpleNamespace(**ok), 16, CUDA) == 116
    assert beside_gemm_sms(SimpleNamespace(**ok), 0, CUDA) is None
    for why in (dict(pdl=False), dict(lora_fused=None), dict(side=object())):
        assert beside_gemm_sms(SimpleNamespace(**{**ok, **why}), 16, CUDA) is None, why
    # a GPU with no more multiprocessors than asked for: the GEMM keeps them all
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=16))
    assert beside_gemm_sms(SimpleNamespace(**ok), 16, CUDA) is None
