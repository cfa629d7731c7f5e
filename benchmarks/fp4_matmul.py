"""Micro-benchmark of the fused FP4 matmul on the 7B (Qwen2.5-7B) decoder-layer shapes.

For M = 1, 16, 64, 256 (decode batch sizes) it reports the weight bytes the FP4 kernel streams
per second (packed codes + block scales) against the measured device copy bandwidth, next to
cuBLAS on the same shapes in bf16, plus the prefill comparison (fused kernel vs dequantize to a
bf16 scratch + cuBLAS) at large M. Timings are CUDA-graph replays of many calls that cycle through
enough weight copies to defeat the 50 MB L2, median of several replays.

    python benchmarks/fp4_matmul.py --json out.json [--sweep] [--fmt nvfp4]

``--sweep`` also times a set of tile configurations per M and prints the best (what
``qerl.kernels.fp4_matmul.CONFIG_TABLE`` is filled from).
"""

# ruff: noqa: B023, B007  (closures are called inside the loop iteration that made them)
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from qerl.kernels import fp4_matmul as fk  # noqa: E402

SHAPES_7B = [  # name, N, K, fused gate/up
    ("q_proj", 3584, 3584, False),
    ("k_proj", 512, 3584, False),
    ("v_proj", 512, 3584, False),
    ("o_proj", 3584, 3584, False),
    ("gate_up", 18944, 3584, True),
    ("down_proj", 3584, 18944, False),
]


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    ts.sort()
    del a, b
    return 2 * nbytes / ts[len(ts) // 2]


def matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    ts.sort()
    return 2 * n**3 / ts[len(ts) // 2]


def graph_time(fns, replays: int = 7) -> float:
    """Seconds per call: CUDA-graph replay of ``fns`` (list of callables), median of replays."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    ts.sort()
    del g
    return ts[len(ts) // 2] / len(fns)


class ShapeSet:
    """Quantized random weights for one shape, in enough copies to exceed the L2."""

    def __init__(self, N: int, K: int, silu: bool, fmt: str, min_bytes: int = 300 << 20):
        per = (2 if silu else 1) * N * K // 2
        self.copies = max(2, -(-min_bytes // per))
        self.N, self.K, self.silu, self.fmt = N, K, silu, fmt
        w = torch.randn(N, K, device="cuda") * 0.02
        base = fk.quantize_fp4(w, fmt)
        base2 = fk.quantize_fp4(torch.randn(N, K, device="cuda") * 0.02, fmt) if silu else None
        self.ws = []
        for _ in range(self.copies):  # distinct storage (same values: timing only)
            d = {k: v.clone() for k, v in base.items()}
            if silu:
                d2 = {k: v.clone() for k, v in base2.items()}
                d["gu"] = {"packed": d2["weight_packed"], "scale": d2["weight_scale"],
                           "global_scale": d2.get("weight_global_scale")}
            self.ws.append(d)
        scale_bytes = base["weight_scale"].numel()
        self.bytes_fp4 = (2 if silu else 1) * (N * K // 2 + scale_bytes)
        self.bytes_bf16 = (2 if silu else 1) * N * K * 2
        self.flops_per_row = (2 if silu else 1) * 2 * N * K
        self.dense = None

    def dense_weights(self):
        if self.dense is None:
            n = max(2, -(-(300 << 20) // self.bytes_bf16))
            self.dense = [torch.randn((2 if self.silu else 1) * self.N, self.K, device="cuda",
                                      dtype=torch.bfloat16) * 0.02 for _ in range(n)]
        return self.dense

    def calls(self, x, cfg=None, perm=False, use_asm=None):
        out = torch.empty(x.shape[0], self.N, device="cuda", dtype=torch.bfloat16)
        fns = []
        for d in self.ws:
            def f(d=d):
                fk.fp4_linear_triton(x, d["weight_packed"], d["weight_scale"], self.fmt,
                                     d.get("weight_global_scale"), gate_up=d.get("gu"),
                                     x_permuted=perm, out=out, config=cfg, use_asm=use_asm)
            fns.append(f)
        return fns


def sweep_configs(M: int):
    """(SWAP, BM, BN, BKW, num_warps, num_stages, programs per SM) candidates for one M.

    The first of the M <= 64 list is the tile-table entry before the 2026-11-30 sweep; the others
    trade shared memory / registers (stages, tile sizes) for occupancy, and change how many
    programs per SM split-K aims at.
    """
    if M <= 16:
        return [(True, 16, 64, 32, 4, 3, 2), (True, 16, 128, 32, 4, 2, 2),
                (True, 16, 64, 32, 4, 2, 4), (True, 16, 64, 64, 4, 2, 2),
                (True, 16, 128, 64, 4, 2, 2), (True, 16, 64, 16, 4, 2, 4),
                (True, 16, 128, 32, 8, 3, 2), (False, 16, 64, 32, 4, 3, 2)]
    if M <= 32:
        return [(True, 32, 128, 32, 4, 3, 2), (True, 32, 64, 16, 4, 2, 4),
                (True, 32, 128, 16, 4, 2, 4), (True, 32, 64, 32, 4, 2, 4),
                (True, 32, 128, 32, 8, 2, 2), (True, 32, 64, 16, 4, 3, 3),
                (True, 32, 128, 16, 8, 3, 3)]
    if M <= 64:
        return [(True, 64, 128, 32, 8, 3, 2), (True, 64, 128, 32, 8, 2, 2),
                (True, 64, 128, 32, 4, 2, 2), (True, 64, 64, 32, 4, 2, 2),
                (True, 64, 64, 32, 4, 3, 2), (True, 64, 64, 16, 4, 2, 4),
                (True, 64, 128, 16, 4, 2, 2), (True, 64, 64, 64, 4, 2, 2),
                (True, 64, 128, 32, 8, 2, 4), (True, 64, 32, 64, 4, 2, 2),
                (True, 64, 128, 16, 8, 3, 3)]
    return [(True, 128, 128, 32, 8, 3, 2), (True, 64, 128, 32, 4, 3, 2),
            (True, 128, 64, 32, 4, 3, 2), (False, 16, 64, 32, 4, 3, 2)]


SWEEP_SHAPES = ("q_proj", "gate_up", "down_proj")


def choose_layout() -> None:
    ok = True
    for fmt in fk.FP4_FORMATS:
        for M, N, K in ((1, 96, 256), (37, 264, 1024), (64, 3584, 3584)):
            w = torch.randn(N, K, device="cuda") * 0.02
            q = fk.quantize_fp4(w, fmt)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            args = (q["weight_packed"], q["weight_scale"], fmt, q.get("weight_global_scale"))
            ref = fk.fp4_linear_reference(x, *args, out_dtype=torch.float32)
            y = fk.fp4_linear_triton(fk.permute_activation(x), *args, x_permuted=True).float()
            rel = float((y - ref).norm() / ref.norm())
            print(f"permuted {fmt} M={M} N={N} K={K}: rel err {rel:.2e}")
            ok = ok and rel < 8e-3
    tn = tp = 0.0
    fk.reserve_workspace(torch.device("cuda"), 64, 18944)
    for name, N, K, silu in SHAPES_7B:
        if name not in SWEEP_SHAPES:
            continue
        ss = ShapeSet(N, K, silu, "nvfp4")
        x = torch.randn(64, K, device="cuda", dtype=torch.bfloat16)
        a = graph_time(ss.calls(x), replays=5)
        b = graph_time(ss.calls(fk.permute_activation(x), perm=True), replays=5)
        print(f"M=64 {name}: natural {a * 1e6:.1f} us, permuted {b * 1e6:.1f} us")
        tn, tp = tn + a, tp + b
    print("LAYOUT=" + ("permuted" if ok and tp < 0.95 * tn else "natural"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="fp4_matmul.json")
    ap.add_argument("--fmt", default="nvfp4", choices=list(fk.FP4_FORMATS) + ["both"])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--ms", default="1,16,64,256")
    ap.add_argument("--sweep-ms", default="16,64", help="M values to sweep tile configs at")
    ap.add_argument("--layouts", default="natural", help="natural,permuted")
    ap.add_argument("--tuning-out", default=None,
                    help="write the best swept tiles here (load with QERL_FP4_TUNING=<file>)")
    ap.add_argument("--choose-layout", action="store_true",
                    help="check the permuted-x path and print LAYOUT=permuted if it is correct "
                         "and faster than natural at M=64 on the 7B shapes, else LAYOUT=natural")
    args = ap.parse_args()
    torch.manual_seed(0)
    if args.choose_layout:
        choose_layout()
        return
    dev = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    rate = matmul_rate()
    print(f"device {dev}; copy bandwidth {bw / 1e12:.2f} TB/s (read+write); "
          f"bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    fmts = list(fk.FP4_FORMATS) if args.fmt == "both" else [args.fmt]
    Ms = [int(m) for m in args.ms.split(",")]
    result = {"device": dev, "copy_bw": bw, "matmul_flops": rate, "rows": [], "sweep": [],
              "prefill": [], "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    fk.reserve_workspace(torch.device("cuda"), 256, 18944)
    sms = fk._num_sms(torch.device("cuda"))
    tuning: dict = {}
    sweep_ms = [int(m) for m in args.sweep_ms.split(",")] if args.sweep else []
    if len({fk._m_bucket(m) for m in sweep_ms}) < len(sweep_ms):
        raise SystemExit(f"--sweep-ms {args.sweep_ms}: sweep one M per tile-table bucket "
                         "(16, 32, 64, 128, 256), or the later M would overwrite the earlier")
    for fmt in fmts:
        sets = {name: ShapeSet(N, K, silu, fmt) for name, N, K, silu in SHAPES_7B}
        for M in Ms:
            x = torch.randn(M, 3584, device="cuda", dtype=torch.bfloat16)
            xd = torch.randn(M, 18944, device="cuda", dtype=torch.bfloat16)
            variants = [(v, v == "permuted") for v in args.layouts.split(",")]
            for vname, perm in variants:
                tot_t, tot_b, tot_bf, tot_tb = 0.0, 0, 0, 0.0
                per = {}
                for name, N, K, silu in SHAPES_7B:
                    ss = sets[name]
                    xin = xd if K == 18944 else x
                    if perm:
                        xin = fk.permute_activation(xin)
                    t = graph_time(ss.calls(xin, perm=perm))
                    dense = ss.dense_weights()
                    xb = xd if K == 18944 else x
                    tb = graph_time([lambda w=w: torch.mm(xb, w.t()) for w in dense])
                    per[name] = {"us": t * 1e6, "GBps": ss.bytes_fp4 / t / 1e9,
                                 "bf16_us": tb * 1e6, "bf16_GBps": ss.bytes_bf16 / tb / 1e9}
                    tot_t += t
                    tot_b += ss.bytes_fp4
                    tot_bf += ss.bytes_bf16
                    tot_tb += tb
                row = {"fmt": fmt, "M": M, "x_layout": vname, "layer_us": tot_t * 1e6,
                       "GBps": tot_b / tot_t / 1e9, "frac_copy_bw": tot_b / tot_t / bw,
                       "bf16_layer_us": tot_tb * 1e6, "bf16_GBps": tot_bf / tot_tb / 1e9,
                       "speedup_vs_bf16": tot_tb / tot_t,
                       "flop_floor_us": sum(s.flops_per_row for s in sets.values()) * M / rate * 1e6,
                       "shapes": per}
                result["rows"].append(row)
                print(f"{fmt} M={M:4d} x={vname:8s} layer {tot_t * 1e6:8.1f} us  "
                      f"{row['GBps']:7.0f} GB/s = {row['frac_copy_bw'] * 100:5.1f}% of copy bw | "
                      f"bf16 cuBLAS {tot_tb * 1e6:8.1f} us ({row['bf16_GBps']:.0f} GB/s) | "
                      f"x{row['speedup_vs_bf16']:.2f} | flop floor {row['flop_floor_us']:.1f} us "
                      + " ".join(f"{k}={v['GBps']:.0f}" for k, v in per.items()), flush=True)
            if args.sweep and fmt == fmts[0] and str(M) in args.sweep_ms.split(","):
                totals = []
                for SW, BM, BN, BKW, nw, stages, per_sm in sweep_configs(M):
                    times, ok = {}, True
                    for name, N, K, silu in SHAPES_7B:
                        if name not in SWEEP_SHAPES:
                            continue
                        ss = sets[name]
                        split = fk.split_k_for(-(-M // BM) * -(-N // BN), K, BKW, per_sm * sms)
                        cfg = fk.Fp4Config(BM=BM, BN=BN, BKW=BKW, SPLIT_K=split, num_warps=nw,
                                           num_stages=stages, SWAP=SW)
                        xin = xd if K == 18944 else x
                        n_failed = len(fk._FAILED_CONFIGS)
                        try:
                            t = graph_time(ss.calls(xin, cfg=cfg), replays=3)
                        except Exception as e:  # noqa: BLE001
                            print(f"  config {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
                            ok = False
                            break
                        if len(fk._FAILED_CONFIGS) > n_failed:
                            print(f"  config {cfg} did not compile")
                            ok = False
                            break
                        times[name] = t
                        result["sweep"].append({"M": M, "shape": name, "SWAP": SW, "BM": BM,
                                                "BN": BN, "BKW": BKW, "num_warps": nw,
                                                "num_stages": stages, "programs_per_sm": per_sm,
                                                "SPLIT_K": split, "us": t * 1e6,
                                                "GBps": ss.bytes_fp4 / t / 1e9})
                    if not ok:
                        continue
                    print(f"  sweep M={M} SWAP={SW} BM={BM} BN={BN} BKW={BKW} warps={nw} "
                          f"stages={stages} programs={per_sm}/SM: "
                          + " ".join(f"{k} {v * 1e6:.1f} us" for k, v in times.items()),
                          flush=True)
                    entry = {"SWAP": SW, "BM": BM, "BN": BN, "BKW": BKW, "num_warps": nw,
                             "num_stages": stages, "programs": per_sm * sms}
                    # per decoder layer: q and o share a shape (k, v are small), down once
                    totals.append((2 * times["q_proj"] + times["down_proj"], False, entry))
                    totals.append((times["gate_up"], True, entry))
                bucket = fk._m_bucket(M)
                for silu in (False, True):
                    cands = [c for c in totals if c[1] == silu]
                    if cands:
                        t, _, entry = min(cands, key=lambda c: c[0])
                        tuning[f"{bucket},{silu}"] = entry
                        print(f"  best M={M} silu={silu}: {entry} ({t * 1e6:.1f} us)", flush=True)
        # prefill: fused kernel vs dequantize + cuBLAS
        for M in (1024, 8192):
            for name in ("gate_up", "down_proj"):
                ss = sets[name]
                K = ss.K
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                t_fused = graph_time(ss.calls(x)[:2], replays=3)
                d = ss.ws[0]
                scratch = torch.empty(ss.N, K, device="cuda", dtype=torch.bfloat16)

                def deq_mm(d=d, x=x, scratch=scratch, ss=ss):
                    fk.fp4_dequantize_triton(d["weight_packed"], d["weight_scale"], fmt,
                                             d.get("weight_global_scale"), out=scratch)
                    torch.mm(x, scratch.t())
                    if ss.silu:
                        fk.fp4_dequantize_triton(d["gu"]["packed"], d["gu"]["scale"], fmt,
                                                 d["gu"].get("global_scale"), out=scratch)
                        torch.mm(x, scratch.t())

                t_deq = graph_time([deq_mm], replays=3)
                rec = {"fmt": fmt, "M": M, "shape": name, "fused_ms": t_fused * 1e3,
                       "dequant_cublas_ms": t_deq * 1e3,
                       "fused_TFLOPs": ss.flops_per_row * M / t_fused / 1e12,
                       "dequant_TFLOPs": ss.flops_per_row * M / t_deq / 1e12}
                result["prefill"].append(rec)
                print(f"prefill {fmt} M={M} {name}: fused {t_fused * 1e3:.3f} ms "
                      f"({rec['fused_TFLOPs']:.0f} TFLOP/s) vs dequant+cuBLAS {t_deq * 1e3:.3f} ms "
                      f"({rec['dequant_TFLOPs']:.0f} TFLOP/s)", flush=True)
        del sets
        torch.cuda.empty_cache()
    result["tuning"] = tuning
    result["config_table"] = {f"{m},{silu}": v for (m, silu), v in fk.CONFIG_TABLE.items()}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    if args.tuning_out and tuning:
        with open(args.tuning_out, "w") as f:
            json.dump(tuning, f, indent=1)
    print("\n| fmt | M | x layout | layer us | GB/s | % copy bw | bf16 cuBLAS us | x vs bf16 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['fmt']} | {r['M']} | {r['x_layout']} | {r['layer_us']:.1f} | {r['GBps']:.0f} | "
              f"{r['frac_copy_bw'] * 100:.1f} | {r['bf16_layer_us']:.1f} | {r['speedup_vs_bf16']:.2f} |")


if __name__ == "__main__":
    main()
