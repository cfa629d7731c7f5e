"""The fast engine's decode attention on one GPU: device time per call of one layer's attention
at decode shapes, replayed as CUDA graphs over 8 layers' caches (more bytes than the L2 holds).

    python benchmarks/attention.py [--model 7b] [--rows 1,64] [--ctx 256] [--splits 0,1,2,6]
        [--tunes 64x4,32x4,128x8] [--json attention.json]

Columns: :func:`qerl.rollout.fast.attention.rope_attention` (the q/k/v epilogue, RoPE and the
K/V write inside the attention's launch) at each split count (0: the engine's choice,
:func:`attention_splits`, for a cache of ``ctx`` + 128 slots), and at the engine's splits each
launch variant of ``--tunes`` (``<slots a block>x<warps>[s<stages>]``; the engine's is 64x4s2). Per cell:
microseconds a layer, the K/V bytes it reads (``ctx`` filled slots a row), their rate and its
share of the measured copy bandwidth. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from sampling import graph_us  # noqa: E402  (benchmarks/sampling.py, beside this script)

from qerl.rollout.fast import attention as A  # noqa: E402
from qerl.rollout.fast import kernels as K  # noqa: E402

HEADS = {"7b": (28, 4, 128), "32b": (40, 8, 128), "72b": (64, 8, 128)}
LAYERS = 8


def copy_bw() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / (graph_us(lambda: b.copy_(a), 10) * 1e-6)


def parse_tune(t: str) -> dict:
    """``64x4`` / ``32x8s2`` -> the kernel's launch options."""
    bl, rest = t.split("x")
    warps, _, stages = rest.partition("s")
    return {"BL": int(bl), "num_warps": int(warps),
            **({"num_stages": int(stages)} if stages else {})}


def cells(model: str, rows: int, ctx: int, splits: list[int], tunes: list[str],
          bw: float) -> list[dict]:
    hq, hkv, d = HEADS[model]
    cap, dev, dt = ctx + 128, "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(rows)
    n = (hq + 2 * hkv) * d
    raw = [torch.randn(rows, n, device=dev, generator=g).to(dt) for _ in range(LAYERS)]
    bias = torch.randn(n, device=dev, generator=g).to(dt)
    kc = [torch.randn(rows, hkv, cap, d, device=dev, generator=g).to(dt) for _ in range(LAYERS)]
    vc = [torch.randn(rows, hkv, cap, d, device=dev, generator=g).to(dt) for _ in range(LAYERS)]
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev).float() / d))
    slot = torch.tensor([ctx - 1], device=dev, dtype=torch.int32)
    pad = torch.zeros(rows, device=dev, dtype=torch.int32)
    cnt = torch.zeros(rows * hkv, device=dev, dtype=torch.int32)
    kv_bytes = 2 * rows * hkv * ctx * d * 2
    out = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    auto = A.attention_splits(rows, hkv, cap, sms)
    runs = [(s or auto, None) for s in splits] + [(auto, t) for t in tunes]
    for S, tune in runs:

        def layers(S=S, tune=tune):
            for i in range(LAYERS):
                epi = K.Epilogue(raw=raw[i][:, :hq * d], bias=bias)
                A.rope_attention(epi, raw[i][:, hq * d:(hq + hkv) * d], raw[i][:, (hq + hkv) * d:],
                                 kc[i], vc[i], inv, slot, pad, 1.0, hq, d, 0.09, S, cnt, pdl=True,
                                 tune=parse_tune(tune) if tune else None)

        us = graph_us(layers, 20) / LAYERS
        out.append({"model": model, "rows": rows, "ctx": ctx, "splits": S,
                    "method": "rope_attention" + (f"_{tune}" if tune else ""), "us": us,
                    "kv_bytes": kv_bytes, "gbps": kv_bytes / us * 1e-3,
                    "frac_copy_bw": kv_bytes / (us * 1e-6) / bw})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="7b", choices=sorted(HEADS))
    ap.add_argument("--rows", default="1,64")
    ap.add_argument("--ctx", default="256", help="filled KV slots a row (comma-separated)")
    ap.add_argument("--splits", default="0,1,2,6", help="0: the engine's choice")
    ap.add_argument("--tunes", default="",
                    help="launch variants of rope_attention, e.g. 32x4,128x8,64x4s3")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU")
    bw = copy_bw()
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.2f} TB/s", flush=True)
    res = [c for r in args.rows.split(",") for ctx in args.ctx.split(",")
           for c in cells(args.model, int(r), int(ctx), [int(s) for s in args.splits.split(",")],
                          [t for t in args.tunes.split(",") if t], bw)]
    print("\n| model | rows | ctx | splits | method | us a layer | GB/s | % copy bw |")
    print("|---|---|---|---|---|---|---|---|")
    for c in res:
        print(f"| {c['model']} | {c['rows']} | {c['ctx']} | {c['splits']} | {c['method']} | "
              f"{c['us']:.1f} | {c['gbps']:.0f} | {100 * c['frac_copy_bw']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_bw": bw,
                       "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "command": "python " + " ".join(sys.argv), "cells": res}, f, indent=1)


if __name__ == "__main__":
    main()
