"""The tuner of humming's FP4 GEMM kernels for our models' decode shapes (GPU only): candidates
around humming's heuristic choice, checked against it, timed with a cold L2, the fastest per M
written to the per-GPU cache of :mod:`qerl.kernels.tuning`.

    python -m qerl.kernels.tune --models 7b,32b --formats nvfp4,mxfp4 --ms 1,32,64,128
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from qerl.kernels.tuning import _key, _store, cache_path, lookup, model_gemm_shapes


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def graph_us(fn: Callable[[], object], reps: int = 10, flush_bytes: int = 128 << 20,
             trials: int = 5) -> float:
    """Device microseconds of one ``fn()`` call, with a cold L2: ``reps`` calls captured in one CUDA
    graph, each after zeroing a ``flush_bytes`` buffer, replayed ``trials`` times (median), minus
    the same graph without the calls. No CPU launch time is in it (the first tuner timed single
    eager calls, ~100 us of Python and launch overhead, as long as the GEMMs themselves)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    buf = torch.empty(flush_bytes // 4, dtype=torch.float32, device=dev)
    stream = torch.cuda.Stream(dev)

    def timed(with_fn: bool) -> float:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if with_fn:
                fn()  # compiled and warm before the capture
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=stream):
                for _ in range(reps):
                    buf.zero_()
                    if with_fn:
                        fn()
            g.replay()
            times = []
            for _ in range(trials):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                g.replay()
                b.record(stream)
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
        torch.cuda.current_stream().wait_stream(stream)
        return sorted(times)[len(times) // 2]

    return max(0.0, (timed(True) - timed(False)) / reps)


def neighbours(cfg: dict) -> list[dict]:
    """``cfg`` and its one-step variations (the tuner's candidates around a heuristic choice)."""
    out = [cfg]
    for key, values in (("num_stages", (3, 4, 6)), ("num_ctas_per_sm", (1, 2)),
                        ("use_stream_k", (True, False))):
        out += [{**cfg, key: v} for v in values if cfg.get(key) != v]
    bs, ws = list(cfg["block_shape"]), list(cfg["warp_shape"])
    out += [{**cfg, "block_shape": [bs[0], bn, bs[2]]} for bn in (128, 256) if bn != bs[1]]
    out += [{**cfg, "block_shape": [bs[0], bs[1], bk],
             "warp_shape": [ws[0], ws[1], bk] if ws[2] == bs[2] else ws}
            for bk in (64, 128) if bk != bs[2]]
    return out


def compile_within(items: Iterable[str], compile_one: Callable[[str], bool], deadline: float,
                   workers: int = 16) -> list[str]:
    """The ``items`` whose ``compile_one`` returned true by ``deadline`` (a ``time.perf_counter``
    value), in their order; the ones not started by then are dropped, the ones still compiling are
    left to finish in the background (a compiler call cannot be interrupted)."""
    items = list(items)
    pool = ThreadPoolExecutor(max_workers=workers)
    futs = [pool.submit(compile_one, s) for s in items]
    left = deadline - time.perf_counter()
    wait(futs, timeout=None if left == float("inf") else max(0.0, left))
    pool.shutdown(wait=False, cancel_futures=True)
    return [s for s, f in zip(items, futs, strict=True)
            if f.done() and not f.cancelled() and f.exception() is None and f.result()]


def tune_shape(fmt: str, n: int, k: int, ms: list[int], samples: int = 0,
               dtype: torch.dtype = torch.bfloat16, log=print,
               deadline: float = float("inf"), layout: str = "ct") -> dict:
    """Tune one GEMM shape (in humming's ``layout`` of it) on the current GPU; returns
    ``{M: {"config", "us", "heuristic_us"}}`` and writes the winners to :func:`cache_path`.
    Candidates still compiling at ``deadline`` are left out (humming's heuristic choice is always
    among the timed ones)."""
    from humming.config import ComputeConfig
    from humming.kernel.humming import HummingKernel
    from humming.testing.tuning import sample_test_tuning_configs
    from humming.tune import get_heuristics_config

    from qerl.kernels.humming_gemm import HummingFp4, config_string
    from qerl.quant.formats import FORMATS

    dev = torch.device("cuda", torch.cuda.current_device())
    w = torch.randn(n, k, device=dev) * 0.02
    t = FORMATS[fmt].quantize(w)
    del w
    gemm = HummingFp4(fmt, [(t["weight_packed"], t["weight_scale"],
                             t.get("weight_global_scale"))], dtype=dtype, layout=layout)
    lc = gemm.layer_config()
    heur = {m: get_heuristics_config(lc, shape_m=m, device=dev) for m in ms}
    cached = lookup(gemm.kind, n, k, dtype, dev)  # the configs tuned before compete too: no regression
    cands = [c for h in heur.values() for c in neighbours(dict(h))]
    cands += [cached[m] for m in ms if m in cached]
    if samples:
        cands += sample_test_tuning_configs(lc, ComputeConfig(gemm_type="dense"),
                                            sample_size=samples)
    unique = {config_string(c): c for c in cands}
    t0 = time.perf_counter()

    errors: list[str] = []

    def compile_one(s: str) -> bool:
        try:
            HummingKernel.prepare_kernels(lc.to_str(), None, s, device=dev)
            return True
        except Exception as e:  # noqa: BLE001 - an illegal candidate
            errors.append(f"{type(e).__name__}: {str(e)[:160]}")
            return False

    # humming's heuristic and the cached choice of every M first: compiled before any deadline
    first = list(dict.fromkeys([config_string(heur[m]) for m in ms]
                               + [config_string(cached[m]) for m in ms if m in cached]))
    legal = compile_within(first, compile_one, float("inf")) + compile_within(
        [s for s in unique if s not in first], compile_one, deadline)
    log(f"  {gemm.kind} {n}x{k}: {len(legal)} of {len(unique)} candidates compiled in "
        f"{time.perf_counter() - t0:.1f}s" + (f"; {len(errors)} failed, e.g. {errors[0]}" if errors else ""))
    result = {}
    for m in ms:
        x = torch.randn(m, k, device=dev, dtype=dtype)
        ref = gemm(x, tuning=config_string(heur[m]))
        timings = []
        for s in legal:
            try:
                y = gemm(x, tuning=s)
                err = _rel(y, ref)
                if not err < 2e-2:
                    log(f"    M={m}: candidate rejected, rel err {err:.3g}")
                    continue
                us = graph_us(lambda s=s, x=x: gemm(x, tuning=s))
            except Exception as e:  # noqa: BLE001 - illegal candidates are skipped
                log(f"    M={m}: candidate failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            timings.append((us, s))
        timings.sort()
        if not timings:
            log(f"    M={m}: no candidate ran; kept humming's heuristic")
            continue
        h_us = next((u for u, s in timings if s == config_string(heur[m])), None)
        best_us, best = timings[0]
        result[m] = {"config": json.loads(best), "us": best_us, "heuristic_us": h_us}
        log(f"    M={m}: best {best_us:.1f} us (heuristic {h_us if h_us is None else round(h_us, 1)}"
            f" us) of {len(timings)}")
    if result:
        _store(cache_path(dev), _key(gemm.kind, n, k, dtype),
               {m: r["config"] for m, r in result.items()}, {"gpu": torch.cuda.get_device_name(dev)})
    return result


def main() -> None:  # pragma: no cover - GPU only
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b,32b")
    ap.add_argument("--formats", default="nvfp4,mxfp4")
    ap.add_argument("--layouts", default="ct,bf16_scales",
                    help="humming layouts to tune (ct: QuantLinear's; bf16_scales: the rollout "
                         "engine's default, nvfp4 only)")
    ap.add_argument("--ms", default="1,32,64,128")
    ap.add_argument("--samples", type=int, default=0, help="extra candidates from humming's sampler")
    ap.add_argument("--only", default=None,
                    help="tune only these layers of the models (of qkv,o,gate_up,down)")
    ap.add_argument("--budget-s", type=float, default=600.0,
                    help="stop after this long (shapes not started are skipped, candidates still "
                         "compiling are dropped)")
    ap.add_argument("--json", default=None, help="also write the timings here")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    t0, report = time.perf_counter(), []
    only = set(args.only.split(",")) if args.only else None
    shapes = dict.fromkeys((n, k) for mdl in args.models.split(",")
                           for name, n, k in model_gemm_shapes(mdl) if only is None or name in only)
    kinds = [(f, lay) for f in args.formats.split(",") for lay in args.layouts.split(",")
             if lay == "ct" or f == "nvfp4"]
    for n, k in shapes:
        for fmt, layout in kinds:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget of {args.budget_s:.0f}s spent; {fmt}/{layout} {n}x{k} not tuned",
                      flush=True)
                continue
            res = tune_shape(fmt, n, k, ms, args.samples, log=lambda s: print(s, flush=True),
                             deadline=t0 + args.budget_s, layout=layout)
            report.append({"fmt": fmt, "layout": layout, "n": n, "k": k,
                           **{str(m): {"us": r["us"], "heuristic_us": r["heuristic_us"]}
                              for m, r in res.items()}})
            if args.json:
                Path(args.json).write_text(json.dumps({"cache": str(cache_path()),
                                                       "shapes": report}, indent=1))
    print(f"tuning file: {cache_path()}", flush=True)


if __name__ == "__main__":  # pragma: no cover
    main()
