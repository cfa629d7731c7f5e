"""The GPU benchmark scripts refuse unknown names before touching the GPU (so a typo in a long
device session fails at once, on any machine)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args,msg", [
    (["--columns", "fast_bf16,fast_nvfp4_lora_typo"], "unknown --columns fast_nvfp4_lora_typo"),
    (["--rows", "7b-64,7b-3"], "unknown --rows 7b-3"),
])
def test_rollout_throughput_refuses_unknown_names(args, msg) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "rollout_throughput.py"), *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert msg in proc.stderr and "known:" in proc.stderr


@pytest.mark.parametrize("method", ["gemvt2_pdl_nvfp4", "gemv4t1t0t2_nvfp4", "gemv4x1p2_nvfp4",
                                    "humming_nvfp5", "cublas_fp8", "gemv_lora_nvfp4",
                                    "humming_pdl_lora32_nvfp4"])
def test_fp4_matmul_refuses_unknown_methods(method) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fp4_matmul.py"),
                           "--methods", f"cublas_bf16,{method}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"unknown method {method!r}" in proc.stderr


def test_fp4_matmul_gemv_variant_names() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fp4_matmul
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert fp4_matmul.gemv_variant("gemv4x1p0t2_pdl_nvfp4") == ((4, 1, 0, 2), 1)
    assert fp4_matmul.gemv_variant("gemv8x2p1_sms124_pdl_mxfp4") == ((8, 2, 1, 1), 1)
    assert fp4_matmul.gemv_variant("gemv_sms124_pdl_nvfp4") == (None, None)
    assert fp4_matmul.gemv_variant("gemv8x2p0_pdl_lora96_nvfp4") == ((8, 2, 0, 1), 1)
    assert fp4_matmul.gemv_variant("gemv8x4p0k6_pdl_nvfp4") == ((8, 4, 0, 1), 6)
    assert fp4_matmul.gemv_variant("gemv4x1p0t2k3_nvfp4") == ((4, 1, 0, 2), 3)
    fp4_matmul.check_methods(["cublas_bf16", "humming_bf16s_pdl_nvfp4", "gemv16x2p0_pdl_nvfp4",
                              "gemv_pdl_mxfp4", "dequant_cublas_nvfp4", "legacy_triton_nvfp4",
                              "gemv_pdl_lora32_nvfp4", "gemv8x4p0k4_pdl_nvfp4"])
