"""Which humming kernels the fast engine compiles before a rollout: decode's (with PDL, and for a
group with LoRA on the multiprocessors the GEMM gets beside it) and prefill's, once each."""

from __future__ import annotations

import types

from qerl.kernels import humming_gemm
from qerl.rollout.fast.gemm import GroupGemm, precompile_groups


def _gemm(r_total: int, humming: str = "h", max_m: int = 10**9, gemv_m: int = 0):
    g = types.SimpleNamespace(group=types.SimpleNamespace(r_total=r_total), humming=humming)
    g.uses_gemv = lambda rows: rows <= gemv_m
    g.uses_humming = lambda rows: gemv_m < rows <= max_m
    g.beside_sms = types.MethodType(GroupGemm.beside_sms, g)  # the engine's rule, on the fake
    return g


def test_decode_kernels_of_lora_groups_are_the_beside_ones(monkeypatch) -> None:
    jobs = []
    monkeypatch.setattr(humming_gemm, "precompile", lambda j: jobs.extend(j))
    gemms = {0: _gemm(96, "qkv"), 1: _gemm(0, "o"), 2: _gemm(64, "gate_up", max_m=64)}
    precompile_groups(gemms, (64, 256), decode_pdl=True, decode_sms=124)
    assert sorted(jobs) == sorted([("qkv", 64, True, 124), ("qkv", 256, False, None),
                                   ("o", 64, True, None), ("o", 256, False, None),
                                   ("gate_up", 64, True, 124)])  # 256 rows: not humming's
    jobs.clear()
    precompile_groups(gemms, (1, 1), decode_pdl=False)  # decode and prefill at one row: one job
    assert sorted(jobs) == sorted([("qkv", 1, False, None), ("o", 1, False, None),
                                   ("gate_up", 1, False, None)])


def test_beside_sms_only_for_humming_groups_with_lora() -> None:
    """The rule decode and precompile share: a GEMM runs beside its LoRA only where there is a
    LoRA and the GEMM is humming's or our GEMV at that many rows."""
    lora, plain = _gemm(32, max_m=64), _gemm(0)
    assert GroupGemm.beside_sms(lora, 64, 124) == 124
    assert GroupGemm.beside_sms(lora, 65, 124) is None  # cuBLAS at 65 rows: the LoRA goes first
    assert GroupGemm.beside_sms(lora, 64, None) is None
    assert GroupGemm.beside_sms(plain, 1, 124) is None
    # our FP4 GEMV (at most gemv_m rows) lets the LoRA start beside it too
    gemv = _gemm(32, max_m=64, gemv_m=1)
    assert GroupGemm.beside_sms(gemv, 1, 124) == 124
    assert GroupGemm.beside_sms(gemv, 8, 124) == 124  # humming's from 2 rows
    assert GroupGemm.beside_sms(_gemm(0, gemv_m=1), 1, 124) is None  # no LoRA
