"""Micro-benchmark of the 4-bit GEMMs on the decode shapes of a model, with a cold L2.

Per GEMM shape of one decoder layer as the fast engine runs it (q/k/v stacked, o, gate/up
stacked, down) and per row count M, every method is timed as a CUDA-graph replay of calls that
each use their own copy of the weights, with enough copies that they hold at least 4x the L2
(so no call finds its weights in the cache); ``us`` is the median replay time over the calls.
GB/s counts the weight bytes a call must read (bf16: 2 B/element; FP4: packed codes + block
scales) and is also given as a fraction of the measured device copy bandwidth (bytes read +
written per second). Methods: ``cublas_bf16`` (F.linear on bf16 weights), ``humming_nvfp4`` /
``humming_mxfp4`` (humming-kernels, tuned configs when the tuning file has them),
``dequant_cublas_<fmt>`` (our Triton dequantize into the scratch + cuBLAS, the training / large-M
path), ``gemv_<fmt>`` (our FP4 GEMV for a few rows, ``qerl.kernels.fp4_gemv``; ``gemv8x2p1_<fmt>``:
8 warps a CTA, batches of 2 steps, the next batch loading while one computes; ``gemv4x1p0t2``:
two tiles of 16 features a CTA; ``_pdl``,
``_sms124`` (at most that many multiprocessors' worth of CTAs) and humming's ``_bf16s`` copy:
see ``_gemm``) and, with ``--legacy``, the removed Triton FP4 kernel (a copy of its old module).

    python benchmarks/fp4_matmul.py --model 7b --ms 1,16,64,256 --json fp4_matmul.json
    python benchmarks/fp4_matmul.py --crossover --ms 64,128,256,512,1024,2048   # humming vs dequant
    python benchmarks/fp4_matmul.py --train    # training autograd: forward+backward, peak memory
    python benchmarks/fp4_matmul.py --overhead --ms 1,64   # what a small humming GEMM costs besides bytes
    python benchmarks/fp4_matmul.py --overhead-split       # where that cost is (configs, K, cuBLAS)
    python benchmarks/fp4_matmul.py --sms-scan --ms 1,64   # the same kernels on 1/4 .. all of the SMs
    python benchmarks/fp4_matmul.py --launch gate_up --model 32b --ms 32  # 3 plain calls, for ncu
    python benchmarks/fp4_matmul.py --halves --model 32b --ms 32  # one GEMM or two halves at once

``--overhead``: humming's NVFP4 GEMM (bf16-scale layout, as the engine runs it) on N x 3584 from
N = 256 (almost no bytes) to the 7B q/k/v and down widths, back-to-back calls without and with
programmatic dependent launch (each call may then start while the one before it finishes), and an
empty kernel (``torch.cuda._sleep(0)``) for a graph's cost per kernel: us a call, cold weights.

``--overhead-split``: one row, PDL on, N x K from 256 x 512 (nothing to stream) to the 7B q/k/v,
for humming's chosen config and the same config without stream-K (no fix-up across CTAs), with
one CTA a multiprocessor, and both; against cuBLAS on bf16 weights of the same shapes and a
Triton kernel that only waits for its predecessor and stores one value (with and without PDL):
the floor of a kernel boundary in our decode chain.

``--halves``: the gate/up and down GEMMs of ``--model`` as one humming GEMM (with and without PDL)
against the same weight as two GEMMs of half the output columns, one after the other (PDL) or on
two streams at once (a fork and a join in the graph): whether a second GEMM's CTAs can use the
multiprocessors the first one's leave idle at its end.

``--sms-scan``: each decode GEMM of ``--model`` as the engine runs it (``--fmt nvfp4 --layout
bf16_scales``, the engine's; ``--layout ct`` / ``--fmt mxfp4`` for the others; its config for the
row count, PDL on) on a quarter, half, three quarters and all of the
multiprocessors (the same kernel on a smaller persistent grid): a GEMM bound by the DRAM keeps
its time on fewer multiprocessors, one bound by what each multiprocessor does (dequantising,
issuing, its own latency) slows in proportion.
"""

# ruff: noqa: B023  (closures are called inside the loop iteration that made them)
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from qerl.kernels import dequant  # noqa: E402
from qerl.kernels.tuning import model_gemm_shapes  # noqa: E402
from qerl.quant.formats import FORMATS  # noqa: E402

L2_BYTES = 60 << 20

try:  # a kernel that only waits for the one before it (``--overhead-split``)
    from qerl.rollout.fast.pdl import pdl_enter, tl, triton

    @triton.jit
    def _noop_kernel(out_ptr, PDL: tl.constexpr):
        pdl_enter(PDL)
        tl.store(out_ptr + tl.program_id(0), 1.0)
except ImportError:  # no Triton: the other tables still run
    _noop_kernel = None


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    return 2 * nbytes / _event_times(lambda: b.copy_(a), 10)


def matmul_rate(n: int = 8192) -> float:
    """bf16 matmul FLOP/s on random data (median of 10)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return 2 * n**3 / _event_times(lambda: a @ b, 10)


def _event_times(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    return sorted(ts)[len(ts) // 2]


def graph_time(fns, replays: int = 7) -> float:
    """Seconds per call: CUDA-graph replay of the calls ``fns``, median of ``replays``."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    t = _event_times(g.replay, replays)
    del g
    return t / len(fns)


def _fp4(n: int, k: int, fmt: str) -> dict:
    return FORMATS[fmt].quantize(torch.randn(n, k, device="cuda") * 0.02)


def _copies(bytes_per_copy: int) -> int:
    return max(2, min(32, -(-4 * L2_BYTES // bytes_per_copy)))


def _fp4_bytes(t: dict) -> int:
    return sum(v.numel() * v.element_size() for v in t.values())


def method_calls(method: str, n: int, k: int, m: int, legacy=None) -> tuple[list, int]:
    """The calls to time (one per weight copy) and the weight bytes one call reads."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if method == "cublas_bf16":
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(_copies(2 * n * k))]
        return [lambda w=w: F.linear(x, w) for w in ws], 2 * n * k
    fmt = method.rsplit("_", 1)[1]
    base = _fp4(n, k, fmt)
    nb = _fp4_bytes(base)
    copies = [{kk: v.clone() for kk, v in base.items()} for _ in range(_copies(nb))]
    if method.startswith(("humming", "gemv")):
        gs = [_gemm(method, fmt, c) for c in copies]
        del copies
        pdl = "pdl" in method.split("_")
        sms = [int(t[3:]) for t in method.split("_") if t.startswith("sms")]
        kw = {"sms": sms[0]} if sms else {}
        rank = [int(t[4:]) for t in method.split("_") if t.startswith("lora")]
        if rank:  # the LoRA inside the launch: a state and adapters a copy
            from qerl.kernels.fp4_gemv_lora import GemvLora

            kw = [{"lora": (GemvLora(g, rank), torch.randn(rank[0], k, device="cuda").bfloat16(),
                            torch.randn(n, rank[0], device="cuda").bfloat16())} for g in gs]
            return [lambda g=g, a=a: g(x, pdl=pdl, **a) for g, a in zip(gs, kw, strict=True)], nb
        return [lambda g=g: g(x, pdl=pdl, **kw) for g in gs], nb
    if method.startswith("dequant_cublas"):
        w = dequant.scratch(x.device, torch.bfloat16, n, k)

        def call(c):
            dequant.dequantize_into(w, fmt, c["weight_packed"], c["weight_scale"],
                                    c.get("weight_global_scale"))
            return F.linear(x, w)

        return [lambda c=c: call(c) for c in copies], nb
    if method.startswith("legacy_triton"):
        return [lambda c=c: legacy.fp4_linear_triton(
            x, c["weight_packed"], c["weight_scale"], fmt, c.get("weight_global_scale"))
            for c in copies], nb
    raise ValueError(method)


FP4 = "(nvfp4|mxfp4)"
METHOD = re.compile(rf"cublas_bf16|dequant_cublas_{FP4}|legacy_triton_{FP4}"
                    rf"|humming(_bf16s)?(_sms\d+)?(_pdl)?_{FP4}"
                    rf"|gemv(\d+x\d+p[01](t[12])?(k\d+)?)?(_sms\d+)?(_pdl)?(_lora\d+)?_{FP4}")
GEMV_VARIANT = re.compile(r"gemv(\d+)x(\d+)p([01])(?:t([12]))?(?:k(\d+))?")


def check_methods(methods: list[str]) -> None:
    """A ValueError naming the first method this script does not know (before any GPU work)."""
    for m in methods:
        if not METHOD.fullmatch(m):
            raise ValueError(f"unknown method {m!r}: known are cublas_bf16, "
                             "humming[_bf16s][_smsN][_pdl]_<fmt>, "
                             "gemv[<W>x<U>p<0|1>[t<1|2>][k<S>]][_smsN][_pdl][_loraR]_<fmt>, "
                             "dequant_cublas_<fmt>, legacy_triton_<fmt> (fmt: nvfp4 or mxfp4)")


def gemv_variant(method: str) -> tuple[tuple[int, ...] | None, int | None]:
    """The ``Fp4Gemv`` variant and split of K a ``gemv*`` method names: ``gemv4x1p0t2_pdl_nvfp4``
    -> ``((4, 1, 0, 2), 1)``, ``gemv8x4p0k4_nvfp4`` -> ``((8, 4, 0, 1), 4)``; ``(None, None)``
    (the shape's defaults) for plain ``gemv``."""
    head = method.split("_")[0]
    if head == "gemv":
        return None, None
    match = GEMV_VARIANT.fullmatch(head)
    if match is None:
        raise ValueError(f"unknown method {method!r}: a GEMV variant is "
                         "gemv<W>x<U>p<0|1>[t<1|2>][k<S>]")
    *variant, split = (int(v) for v in match.groups(default="1"))
    return tuple(variant), split


def _gemm(method: str, fmt: str, t: dict):
    """The GEMM object a ``humming*`` / ``gemv*`` method times: ``humming[_bf16s][_pdl]_<fmt>``
    (humming's ``ct`` or ``bf16_scales`` copy, tuned configs where the file has them),
    ``gemv[WxUpP[tT][kS]][_pdl]_<fmt>`` (our FP4 GEMV, :mod:`qerl.kernels.fp4_gemv`, with W
    warps a CTA, U steps a batch, pipelined P = 0 / 1, T tiles a CTA, K split over S CTAs; its
    defaults for the shape without ``WxUpP``; ``_loraR``: with a rank-R LoRA inside its launch)."""
    member = [(t["weight_packed"], t["weight_scale"], t.get("weight_global_scale"))]
    head = method.split("_")[0]
    if head == "humming":
        from qerl.kernels.humming_gemm import HummingFp4

        return HummingFp4(fmt, member,
                          layout="bf16_scales" if "bf16s" in method.split("_") else "ct")
    from qerl.kernels.fp4_gemv import Fp4Gemv

    variant, split = gemv_variant(method)
    return Fp4Gemv(fmt, member, variant=variant, split_k=split)


def check_accuracy(method: str, n: int, k: int, m: int, legacy=None) -> float:
    """Relative error of one call against dequantize-in-float32-then-matmul."""
    if method == "cublas_bf16":
        return 0.0
    fmt = method.rsplit("_", 1)[1]
    t = _fp4(n, k, fmt)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ FORMATS[fmt].dequantize(t, torch.float32).t()
    if method.startswith(("humming", "gemv")):
        g = _gemm(method, fmt, t)
        y = g(x)
        if getattr(g, "col_scale", None) is not None:  # humming's, for the consumer to apply
            y = y.float() * g.col_scale
    elif method.startswith("dequant"):
        w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        y = F.linear(x, dequant.dequantize_into(w, fmt, t["weight_packed"], t["weight_scale"],
                                                t.get("weight_global_scale")))
    else:
        y = legacy.fp4_linear_triton(x, t["weight_packed"], t["weight_scale"], fmt,
                                     t.get("weight_global_scale"))
    return float((y.float() - ref).norm() / ref.norm())


def run_shapes(args, results: dict, dump, legacy) -> None:
    methods = args.methods.split(",")
    if legacy is not None:
        methods += ["legacy_triton_nvfp4"]
    only = set(args.only.split(",")) if args.only else None
    names = {name for name, _, _ in model_gemm_shapes(args.model)}
    if only is not None and not only <= names:
        raise SystemExit(f"--only: {sorted(only - names)} not layers of {args.model} "
                         f"({', '.join(sorted(names))})")
    for name, n, k in model_gemm_shapes(args.model):
        if only is not None and name not in only:
            continue
        for m in [int(v) for v in args.ms.split(",")]:
            for method in methods:
                try:
                    calls, nbytes = method_calls(method, n, k, m, legacy)
                    t = graph_time(calls)
                    err = check_accuracy(method, n, k, m, legacy)
                    cell = {"shape": name, "n": n, "k": k, "m": m, "method": method,
                            "us": t * 1e6, "weight_bytes": nbytes, "gbps": nbytes / t / 1e9,
                            "frac_copy_bw": nbytes / t / results["copy_bw"], "rel_err": err,
                            "copies": len(calls)}
                    del calls
                except Exception as e:  # noqa: BLE001 - record it and go on
                    cell = {"shape": name, "n": n, "k": k, "m": m, "method": method,
                            "error": f"{type(e).__name__}: {e}"[:300]}
                torch.cuda.empty_cache()
                results["cells"].append(cell)
                dump()
                print(json.dumps(cell), flush=True)


def _timed(cell: dict, fns) -> dict:
    """``cell`` with ``us`` (a CUDA-graph replay of ``fns``, us a call) or the ``error``; printed."""
    try:
        cell["us"] = graph_time(fns) * 1e6
    except Exception as e:  # noqa: BLE001 - record it and go on
        cell["error"] = f"{type(e).__name__}: {e}"[:300]
    print(json.dumps(cell), flush=True)
    return cell


def _table(cells: list[dict], header: list[str], row) -> None:
    """Print a markdown table: ``header``, then ``row(cell)`` (a list of strings) per timed cell."""
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for c in cells:
        if "us" in c:
            print("| " + " | ".join(row(c)) + " |")
        else:
            print(f"| {c['shape']} | error: {c['error'][:60]} |")


def _humming_copies(n: int, k: int, fmt: str = "nvfp4", layout: str = "bf16_scales",
                    count: int | None = None) -> list:
    """``count`` humming GEMMs of one random ``n x k`` weight (each prepares its own copy; by
    default enough of them for a cold L2)."""
    from qerl.kernels.humming_gemm import HummingFp4

    base = _fp4(n, k, fmt)
    return [HummingFp4(fmt, [(base["weight_packed"], base["weight_scale"],
                               base.get("weight_global_scale"))], layout=layout)
            for _ in range(count or _copies(_fp4_bytes(base)))]


def run_overhead(args, results: dict, dump) -> None:
    """The ``--overhead`` table (see the module docstring)."""
    k = 3584
    cells = [_timed({"shape": "empty kernel", "n": 0, "k": 0, "m": 0, "pdl": False,
                     "weight_bytes": 0}, [lambda: torch.cuda._sleep(0)] * 32)]
    for n in (256, 1024, 4608, 18944):
        gs = _humming_copies(n, k)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for pdl in (False, True):
                cells.append(_timed({"shape": f"{n}x{k}", "n": n, "k": k, "m": m, "pdl": pdl,
                                     "weight_bytes": gs[0].nbytes()},
                                    [lambda g=g: g(x, pdl=pdl) for g in gs]))
        del gs
        torch.cuda.empty_cache()
    results["cells"] += cells
    dump()
    _table(cells, ["shape", "M", "PDL", "us a call", "GB/s"],
           lambda c: [c["shape"], str(c["m"]), str(c["pdl"]), f"{c['us']:.2f}",
                      f"{c['weight_bytes'] / c['us'] * 1e-3:.0f}"])


def run_overhead_split(results: dict, dump) -> None:
    """The ``--overhead-split`` table (see the module docstring)."""
    from qerl.kernels.humming_gemm import config_string
    from qerl.rollout.fast.pdl import launch_kw

    o = torch.zeros(132, device="cuda")
    cells = [_timed({"shape": "triton store", "method": "triton_noop", "pdl": pdl,
                     "weight_bytes": 0},
                    [lambda pdl=pdl: _noop_kernel[(132,)](o, **launch_kw(pdl))] * 32)
             for pdl in (False, True)]
    for n, k in ((256, 512), (256, 3584), (4608, 512), (4608, 3584)):
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
              for _ in range(_copies(2 * n * k))]
        cells.append(_timed({"shape": f"{n}x{k}", "method": "cublas_bf16", "pdl": False,
                             "weight_bytes": 2 * n * k}, [lambda w=w: F.linear(x, w) for w in ws]))
        del ws
        gs = _humming_copies(n, k)
        cfg = json.loads(gs[0].tuning_for(1, True))
        for name, change in (("chosen", {}), ("no_stream_k", {"use_stream_k": False}),
                             ("1_cta_per_sm", {"num_ctas_per_sm": 1}),
                             ("no_stream_k_1_cta", {"use_stream_k": False, "num_ctas_per_sm": 1})):
            tuning = config_string({**cfg, **change})
            cells.append(_timed({"shape": f"{n}x{k}", "method": f"humming_{name}", "pdl": True,
                                 "weight_bytes": gs[0].nbytes(), "config": tuning},
                                [lambda g=g: g(x, pdl=True, tuning=tuning) for g in gs]))
        del gs
        torch.cuda.empty_cache()
    results["cells"] += cells
    dump()
    _table(cells, ["shape", "method", "PDL", "us a call"],
           lambda c: [c["shape"], c["method"], str(c["pdl"]), f"{c['us']:.2f}"])


def run_sms_scan(args, results: dict, dump) -> None:
    """The ``--sms-scan`` table (see the module docstring)."""
    from qerl.kernels.humming_gemm import config_string, on_sms

    total = torch.cuda.get_device_properties(0).multi_processor_count
    for name, n, k in model_gemm_shapes(args.model):
        gs = _humming_copies(n, k, args.fmt, args.layout)
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cfg = json.loads(gs[0].tuning_for(m, True))
            for f in (4, 2, 4 / 3, 1):
                sms = int(round(total / f))
                tuning = config_string(on_sms(cfg, sms))
                results["cells"].append(_timed(
                    {"shape": name, "n": n, "k": k, "m": m, "sms": sms, "fmt": args.fmt,
                     "layout": args.layout, "weight_bytes": gs[0].nbytes()},
                    [lambda g=g: g(x, pdl=True, tuning=tuning) for g in gs]))
        del gs
        torch.cuda.empty_cache()
    dump()
    _table(results["cells"], ["shape", "M", "SMs", "us a call", "GB/s"],
           lambda c: [f"{c['shape']} {c['n']}x{c['k']}", str(c["m"]), str(c["sms"]),
                      f"{c['us']:.2f}", f"{c['weight_bytes'] / c['us'] * 1e-3:.0f}"])


def run_halves(args, results: dict, dump) -> None:
    """The ``--halves`` table (see the module docstring)."""
    from qerl.kernels.humming_gemm import HummingFp4

    side = torch.cuda.Stream()
    for name, n, k in model_gemm_shapes(args.model):
        if name not in ("gate_up", "down"):
            continue
        base = _fp4(n, k, "nvfp4")
        h = n // 2

        def gemm(rows: slice, t: dict) -> HummingFp4:
            return HummingFp4("nvfp4", [(t["weight_packed"][rows], t["weight_scale"][rows],
                                         t["weight_global_scale"])], layout="bf16_scales")

        copies = range(_copies(_fp4_bytes(base)))  # each HummingFp4 prepares its own copy
        full = [gemm(slice(0, n), base) for _ in copies]
        halves = [(gemm(slice(0, h), base), gemm(slice(h, n), base)) for _ in copies]
        for m in [int(v) for v in args.ms.split(",")]:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def both(a, b):
                side.wait_stream(torch.cuda.current_stream())
                a(x)
                with torch.cuda.stream(side):
                    b(x)
                torch.cuda.current_stream().wait_stream(side)

            cases = {"one": [lambda g=g: g(x) for g in full],
                     "one_pdl": [lambda g=g: g(x, pdl=True) for g in full],
                     "halves_pdl": [lambda a=a, b=b: (a(x, pdl=True), b(x, pdl=True))
                                    for a, b in halves],
                     "halves_two_streams": [lambda a=a, b=b: both(a, b) for a, b in halves]}
            for case, fns in cases.items():
                results["cells"].append(_timed(
                    {"shape": name, "n": n, "k": k, "m": m, "case": case,
                     "weight_bytes": full[0].nbytes()}, fns))
        del full, halves
        torch.cuda.empty_cache()
    dump()
    _table(results["cells"], ["shape", "M", "case", "us a GEMM", "GB/s"],
           lambda c: [f"{c['shape']} {c['n']}x{c['k']}", str(c["m"]), c["case"],
                      f"{c['us']:.2f}", f"{c['weight_bytes'] / c['us'] * 1e-3:.0f}"])


def run_launch(args) -> None:
    """``--launch SHAPE``: three eager calls of that decode GEMM of ``--model`` at the first of
    ``--ms`` rows, as the engine runs it (for a profiler: the first call compiles)."""
    shapes = {name: (n, k) for name, n, k in model_gemm_shapes(args.model)}
    n, k = shapes[args.launch]
    (g,) = _humming_copies(n, k, args.fmt, args.layout, count=1)
    x = torch.randn(int(args.ms.split(",")[0]), k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        g(x)
    torch.cuda.synchronize()
    print(f"{args.launch} {n}x{k} at M={x.shape[0]}: config {g.tuning_for(x.shape[0])}", flush=True)


def run_train(results: dict, dump) -> None:
    """Forward + backward of a stack of FP4 layers at training size: the autograd function
    against plain autograd on the torch-dequantized weight (which saves every weight)."""
    from torch import nn

    from qerl.quant.linear import QuantLinear

    n, k, depth, m = 18944, 3584, 4, 4096
    for fmt in ("nvfp4", "mxfp4"):
        layers = []
        for _ in range(depth):
            lin = nn.Linear(k, n, bias=False, device="cuda")
            layers.append((QuantLinear.from_linear(lin, fmt), QuantLinear.from_linear(
                nn.Linear(n, k, bias=False, device="cuda"), fmt)))
            del lin

        def step(plain: bool):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            h = x
            for up, down in layers:
                if plain:
                    h = F.linear(F.silu(F.linear(h, up.dequantize(torch.bfloat16))),
                                 down.dequantize(torch.bfloat16))
                else:
                    h = down(F.silu(up(h)))
            h.float().square().mean().backward()
            return x.grad

        for plain in (True, False):
            step(plain)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            for _ in range(3):
                step(plain)
            torch.cuda.synchronize()
            cell = {"train": True, "fmt": fmt, "method": "plain_autograd" if plain else "fp4_fn",
                    "m": m, "layers": f"{depth}x({n}x{k} + {k}x{n})",
                    "ms_fwd_bwd": (time.perf_counter() - t0) / 3 * 1e3,
                    "peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30}
            results["cells"].append(cell)
            dump()
            print(json.dumps(cell), flush=True)
        layers.clear()
        torch.cuda.empty_cache()


def main() -> None:  # pragma: no cover - GPU only
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="7b")
    ap.add_argument("--ms", default="1,16,64,256")
    ap.add_argument("--methods", default="cublas_bf16,humming_nvfp4,humming_mxfp4,"
                                         "dequant_cublas_nvfp4")
    ap.add_argument("--crossover", action="store_true",
                    help="only humming vs Triton dequantize + cuBLAS (the humming_max_m choice)")
    ap.add_argument("--train", action="store_true", help="only the training autograd timing")
    ap.add_argument("--overhead", action="store_true",
                    help="only humming's cost per call from tiny to 7B widths, with and without PDL")
    ap.add_argument("--overhead-split", action="store_true",
                    help="only where a small humming GEMM's fixed cost is (configs, K, cuBLAS)")
    ap.add_argument("--sms-scan", action="store_true",
                    help="only the decode GEMMs on 1/4, 1/2, 3/4 and all of the multiprocessors")
    ap.add_argument("--halves", action="store_true",
                    help="only gate/up and down as one GEMM or two halves (in turn, or at once)")
    ap.add_argument("--only", default=None,
                    help="comma-separated layers of --model to time (qkv, o, gate_up, down; "
                         "all if left out)")
    ap.add_argument("--launch", default=None, choices=("qkv", "o", "gate_up", "down"),
                    help="only three plain calls of that GEMM (for a profiler)")
    ap.add_argument("--fmt", default="nvfp4", choices=("nvfp4", "mxfp4"),
                    help="--sms-scan: the 4-bit format")
    ap.add_argument("--layout", default="bf16_scales", choices=("bf16_scales", "ct"),
                    help="--sms-scan: humming's copy (bf16_scales: NVFP4 only, the engine's)")
    ap.add_argument("--legacy", default=None, help="path of the old Triton FP4 module to compare")
    ap.add_argument("--json", default="fp4_matmul.json")
    args = ap.parse_args()
    if args.layout == "bf16_scales" and args.fmt != "nvfp4":
        ap.error("--layout bf16_scales is for --fmt nvfp4 only; use --layout ct")
    if args.launch:
        run_launch(args)
        return
    if args.crossover:
        args.methods = "humming_nvfp4,dequant_cublas_nvfp4,humming_mxfp4,dequant_cublas_mxfp4"
    try:
        check_methods(args.methods.split(","))
    except ValueError as e:
        ap.error(str(e))
    legacy = None
    if args.legacy:
        import importlib.util

        spec = importlib.util.spec_from_file_location("legacy_fp4", args.legacy)
        legacy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(legacy)
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
               "command": "python " + " ".join(sys.argv), "torch": torch.__version__,
               "copy_bw": copy_bandwidth(), "matmul_flops": matmul_rate(), "l2_bytes": L2_BYTES,
               "cells": []}
    try:
        import humming

        results["humming"] = humming.__version__
    except ImportError:
        pass
    print(f"{results['device']}: copy {results['copy_bw'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{results['matmul_flops'] / 1e12:.0f} TFLOP/s", flush=True)

    def dump():
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)

    if args.train:
        run_train(results, dump)
    elif args.overhead:
        run_overhead(args, results, dump)
        return
    elif args.overhead_split:
        run_overhead_split(results, dump)
        return
    elif args.sms_scan:
        run_sms_scan(args, results, dump)
        return
    elif args.halves:
        run_halves(args, results, dump)
        return
    else:
        run_shapes(args, results, dump, legacy)
    print("\n| shape | M | method | us | GB/s | % copy bw | rel err |")
    print("|---|---|---|---|---|---|---|")
    for c in results["cells"]:
        if "us" in c:
            print(f"| {c['shape']} {c['n']}x{c['k']} | {c['m']} | {c['method']} | {c['us']:.1f} | "
                  f"{c['gbps']:.0f} | {100 * c['frac_copy_bw']:.1f} | {c['rel_err']:.4f} |")
        elif "error" in c:
            print(f"| {c['shape']} | {c['m']} | {c['method']} | error: {c['error'][:60]} | | | |")
    dump()


if __name__ == "__main__":  # pragma: no cover
    main()
