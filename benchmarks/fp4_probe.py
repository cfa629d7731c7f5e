"""Why is the FP4 matmul slow at decode shapes? A probe for the H200 (GPU only).

1. Times our fused kernel (NVFP4 and MXFP4) at M=64 on the 7B gate/up and down shapes, against
   bf16 cuBLAS and against Triton's own ``tl.dot_scaled`` (bf16 x e2m1 with e8m0 scales: MXFP4
   only; on Hopper the compiler upcasts the FP4 operand itself), each checked against
   dequantize-then-matmul in float32 first.
2. ``--ncu-target``: runs only our kernel a few times, for Nsight Compute:

    ncu --kernel-name regex:_fp4_mm_kernel --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
        python benchmarks/fp4_probe.py --ncu-target

    python benchmarks/fp4_probe.py --json probe.json
"""

# ruff: noqa: B023  (the timed closures run inside the loop iteration that made them)
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from qerl.kernels import fp4_matmul as fk  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from fp4_matmul import graph_time  # noqa: E402

SHAPES = [("gate_proj", 18944, 3584), ("down_proj", 3584, 18944), ("q_proj", 3584, 3584)]


@triton.jit
def _dot_scaled_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr):
    """y[M, N] = x[M, K] @ W^T for MXFP4 W ([N, K/2] packed codes, [N, K/32] e8m0 scales)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=offs_m[:, None] < M,
                    other=0.0)
        offs_kb = k0 // 2 + tl.arange(0, BK // 2)
        w = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * (K // 2) + offs_kb[:, None],
                    mask=offs_n[None, :] < N, other=0)  # [BK/2, BN], packed along K
        offs_g = k0 // 32 + tl.arange(0, BK // 32)
        s = tl.load(s_ptr + offs_n[:, None].to(tl.int64) * (K // 32) + offs_g[None, :],
                    mask=offs_n[:, None] < N, other=127)  # [BN, BK/32]
        acc = tl.dot_scaled(x, None, "bf16", w, s, "e2m1", acc)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16),
             mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def dot_scaled_linear(x, packed, scale, BM=64, BN=64, BK=256, num_warps=4, num_stages=3):
    M, K = x.shape
    N = packed.shape[0]
    if K % BK:
        raise ValueError(f"the dot_scaled probe kernel has no K mask: K={K} must be a multiple of {BK}")
    y = torch.empty((M, N), dtype=torch.bfloat16, device=x.device)
    grid = (triton.cdiv(N, BN), triton.cdiv(M, BM))
    _dot_scaled_kernel[grid](x, packed, scale.view(torch.uint8), y, M, N, K, BM=BM, BN=BN, BK=BK,
                             num_warps=num_warps, num_stages=num_stages)
    return y


def bench(fn_per_copy, copies: int) -> float:
    """Microseconds per call: CUDA-graph replays cycling through ``copies`` weight copies (the L2
    is defeated; no Python launch overhead in the timing)."""
    return graph_time([lambda i=i: fn_per_copy(i) for i in range(copies)], replays=5) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="fp4_probe.json")
    ap.add_argument("--M", type=int, default=64)
    ap.add_argument("--ncu-target", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    M = args.M
    if args.ncu_target:
        _, N, K = SHAPES[0]
        q = fk.quantize_fp4(torch.randn(N, K, device="cuda"), "nvfp4")
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        for _ in range(4):
            fk.fp4_linear_triton(x, q["weight_packed"], q["weight_scale"], "nvfp4",
                                 q["weight_global_scale"])
        torch.cuda.synchronize()
        return
    fk.reserve_workspace(torch.device("cuda"), M, 18944)
    rows = []
    for name, N, K in SHAPES:
        w = torch.randn(N, K, device="cuda")
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        wb = w.to(torch.bfloat16)
        copies = max(2, int(200e6 // (N * K // 2)) + 1)
        wbs = [wb.clone() for _ in range(max(2, int(200e6 // (N * K * 2)) + 1))]
        t_bf16 = bench(lambda i: x @ wbs[i % len(wbs)].t(), len(wbs))
        row = {"shape": name, "M": M, "N": N, "K": K, "bf16_us": t_bf16}
        for fmt in ("nvfp4", "mxfp4"):
            q = fk.quantize_fp4(w, fmt)
            qs = [{k: v.clone() for k, v in q.items()} for _ in range(copies)]
            ref = fk.fp4_linear_reference(x, q["weight_packed"], q["weight_scale"], fmt,
                                          q.get("weight_global_scale"), out_dtype=torch.float32)
            y = fk.fp4_linear_triton(x, q["weight_packed"], q["weight_scale"], fmt,
                                     q.get("weight_global_scale")).float()
            row[f"{fmt}_ours_relerr"] = float((y - ref).norm() / ref.norm())
            row[f"{fmt}_ours_us"] = bench(
                lambda i: fk.fp4_linear_triton(x, qs[i]["weight_packed"], qs[i]["weight_scale"],
                                               fmt, qs[i].get("weight_global_scale")), copies)
            nbytes = N * K // 2 + q["weight_scale"].numel()
            row[f"{fmt}_ours_GBs"] = nbytes / row[f"{fmt}_ours_us"] / 1e3
            if fmt == "mxfp4":
                for cfg in ((64, 64, 256, 4, 3), (64, 128, 256, 8, 3), (64, 32, 512, 4, 3),
                            (64, 64, 128, 4, 4)):
                    tag = "ds_" + "_".join(map(str, cfg))
                    try:
                        y = dot_scaled_linear(x, q["weight_packed"], q["weight_scale"], *cfg)
                        row[f"{tag}_relerr"] = float((y.float() - ref).norm() / ref.norm())
                        row[f"{tag}_us"] = bench(
                            lambda i: dot_scaled_linear(x, qs[i]["weight_packed"],
                                                        qs[i]["weight_scale"], *cfg), copies)
                        row[f"{tag}_GBs"] = nbytes / row[f"{tag}_us"] / 1e3
                    except Exception as e:  # noqa: BLE001 - report and go on
                        row[f"{tag}_error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
        wbs = qs = None
        torch.cuda.empty_cache()
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":  # pragma: no cover
    main()
