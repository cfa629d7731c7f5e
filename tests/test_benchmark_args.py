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
