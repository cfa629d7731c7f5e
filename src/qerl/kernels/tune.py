"""The tuner of humming's FP4 GEMM kernels for our models' decode shapes (GPU only): candidates
checked against humming's heuristic choice, timed with a cold L2, the fastest per M written to the
per-GPU cache of :mod:`qerl.kernels.tuning`.

Two searches (``--search``), per row count M:

- ``near``: humming's heuristic choice and its one-step neighbours (:func:`neighbours`);
- ``wide``: that, then three stages, each compiled in parallel and timed the same way:
  1. tiles (:func:`tile_candidates`): both MMA kinds (``mma``; ``wgmma`` with TMA and a
     producer warp group) x block N x block K, the M tile fitted to M;
  2. around the ``TOP`` fastest tiles (:func:`around`): warp shape, pipeline stages and their
     unrolling, CTAs per SM, stream-K, the epilogue's shared memory and chunking and the TMA /
     wgmma switches, one at a time;
  3. each of those tiles with every stage-2 change that beat it, together (:func:`combine`).

Candidates humming's own checks reject (geometry, registers, shared memory) are dropped before
they are compiled (:func:`humming_legal`).

    python -m qerl.kernels.tune --models 7b,32b --formats nvfp4 --ms 1,32,64 --search wide
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import torch

from qerl.kernels.tune_space import TOP, _tile, around, combine, neighbours, tile_candidates
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


def humming_legal(lc) -> Callable[[dict], bool]:
    """humming's own checks of a tuning config for the layer config ``lc`` (MMA kind, geometry,
    registers, shared memory; from its test sampler, ``humming.testing.tuning``); where they
    cannot run (another humming version), every config passes and the compiler decides."""
    try:
        import dataclasses

        from humming.config import ComputeConfig, MmaType, TuningConfig
        from humming.device import current_device
        from humming.testing import tuning as ht

        defaults = {f.name: f.default for f in dataclasses.fields(TuningConfig)
                    if f.default is not dataclasses.MISSING}
        cc = ComputeConfig(gemm_type="dense")
        sms = current_device.sm_count
    except Exception:  # noqa: BLE001 - no checks to run
        return lambda cfg: True

    def legal(cfg: dict) -> bool:
        full = {**defaults, "num_sms": sms, "use_f16_accum": False, **cfg}
        for f in ht.TMA_FIELDS:
            if full.get(f) is None:
                full[f] = bool(full.get("use_tma"))
        try:
            mt = MmaType(full["mma_type"])
            return bool(ht._is_legal_mma_type(lc, cc, mt)
                        and ht._is_legal_geometry(lc, tuple(full["block_shape"]),
                                                  tuple(full["warp_shape"]), mt)
                        and ht._try_combine_candidate(lc, cc, ((full, {}),)) is not None)
        except Exception:  # noqa: BLE001 - a check that broke decides nothing
            return True

    return legal


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


class _Shape:
    """One GEMM shape being tuned: its humming GEMM, the legality check, the deadline and the
    compile results, which every row count shares (humming compiles a config once per shape)."""

    def __init__(self, gemm, deadline: float, log) -> None:
        from humming.kernel.humming import HummingKernel

        self.gemm, self.deadline, self.log = gemm, deadline, log
        self.lc = gemm.layer_config()
        self.legal = humming_legal(self.lc)
        self.compiled: dict[str, bool] = {}  # config string -> compiled (absent: not tried)
        self.errors: list[str] = []
        self._kernel = HummingKernel

    def _compile_one(self, s: str) -> bool:
        try:
            self._kernel.prepare_kernels(self.lc.to_str(), None, s, device=self.gemm.device)
            return True
        except Exception as e:  # noqa: BLE001 - an illegal candidate
            self.errors.append(f"{type(e).__name__}: {str(e)[:160]}")
            self.compiled[s] = False
            return False

    def compile(self, strings: list[str], must: bool) -> None:
        """Compile the ``strings`` not tried yet (``must``: whatever the deadline)."""
        fresh = [s for s in strings if s not in self.compiled]
        if fresh and (must or time.perf_counter() < self.deadline):
            for s in compile_within(fresh, self._compile_one,
                                    float("inf") if must else self.deadline):
                self.compiled[s] = True


def _tune_m(shape: _Shape, m: int, heur: dict, cached: dict | None, extra: list[dict],
            search: str, sms: int | None = None) -> dict[str, tuple[float, dict]]:
    """Every candidate timed at ``m`` rows: ``{config string: (us, config)}`` (the searches of
    the module docstring; candidates that fail to compile or disagree with the heuristic kernel's
    output are left out); ``sms``: every candidate on at most that many multiprocessors."""
    from qerl.kernels.humming_gemm import config_string, on_sms

    gemm, log = shape.gemm, shape.log
    x = torch.randn(m, gemm.k, device=gemm.device, dtype=gemm.dtype)
    ref = gemm(x, tuning=config_string(heur))
    timed: dict[str, tuple[float, dict]] = {}

    def run(cands: list[dict], forced: list[dict] | tuple = (), stage: str = "") -> None:
        """Compile (``forced``: whatever the deadline and humming's checks), check and time the
        new ones, in one parallel batch."""
        todo: dict[str, dict] = {}
        capped = [(config_string(c), c) for c in (on_sms(c, sms) for c in [*forced, *cands])]
        must = {s for s, _ in capped[:len(forced)]}
        for s, c in capped:
            if s not in timed and shape.compiled.get(s) is not False \
                    and (s in must or shape.legal(c)):
                todo.setdefault(s, c)
        t0 = time.perf_counter()
        shape.compile(list(todo), must=bool(forced))
        ran = 0
        for s, c in todo.items():
            if not shape.compiled.get(s):
                continue
            try:
                err = _rel(gemm(x, tuning=s), ref)
                if not err < 2e-2:
                    log(f"    M={m}: candidate rejected, rel err {err:.3g}: {s}")
                    continue
                timed[s] = (graph_us(lambda s=s: gemm(x, tuning=s)), c)
                ran += 1
            except Exception as e:  # noqa: BLE001 - illegal candidates are skipped
                log(f"    M={m}: candidate failed: {type(e).__name__}: {str(e)[:120]}")
        best = min((u for u, _ in timed.values()), default=float("nan"))
        log(f"    M={m} {stage}: {ran} of {len(todo)} timed ({time.perf_counter() - t0:.1f}s);"
            f" best so far {best:.1f} us")

    run(neighbours(heur) + extra, forced=[heur] + ([cached] if cached else []), stage="near")
    if search == "wide":
        run(tile_candidates(heur, m), stage="tiles")
        tops, seen = [], set()
        for us, c in sorted(timed.values(), key=lambda t: t[0]):
            if _tile(c) not in seen and len(tops) < TOP:
                seen.add(_tile(c))
                tops.append((us, c, around(c)))
        run([v for _, _, vs in tops for v in vs], stage="around the fastest tiles")
        run([c for us, top, vs in tops
             if (c := combine(top, [timed[s] for s in map(config_string, vs) if s in timed], us))
             is not None], stage="combined")
    return timed


def tune_shape(fmt: str, n: int, k: int, ms: list[int], samples: int = 0,
               dtype: torch.dtype = torch.bfloat16, log=print,
               deadline: float = float("inf"), layout: str = "ct",
               search: str = "near", sms: int | None = None) -> dict:
    """Tune one GEMM shape (in humming's ``layout`` of it) on the current GPU; returns
    ``{M: {"config", "us", "heuristic_us", "cached_us", "timed"}}`` and writes the winners to
    :func:`cache_path` (as ``"M@sms"`` with ``sms``: every candidate on at most that many
    multiprocessors). ``search``: ``near`` or ``wide`` (the module docstring). Candidates still
    compiling at ``deadline`` are left out (humming's heuristic choice and the cached one are
    always compiled and timed)."""
    if search not in ("near", "wide"):  # before any import or GPU work
        raise ValueError(f"search must be 'near' or 'wide', got {search!r}")
    if sms is not None and not (isinstance(sms, int) and sms > 0):
        raise ValueError(f"sms must be a positive number of multiprocessors, got {sms!r}")
    from humming.config import ComputeConfig
    from humming.testing.tuning import sample_test_tuning_configs
    from humming.tune import get_heuristics_config

    from qerl.kernels.humming_gemm import HummingFp4, config_string, on_sms
    from qerl.quant.formats import FORMATS

    dev = torch.device("cuda", torch.cuda.current_device())
    w = torch.randn(n, k, device=dev) * 0.02
    t = FORMATS[fmt].quantize(w)
    del w
    gemm = HummingFp4(fmt, [(t["weight_packed"], t["weight_scale"],
                             t.get("weight_global_scale"))], dtype=dtype, layout=layout)
    shape = _Shape(gemm, deadline, log)
    cached = lookup(gemm.kind, n, k, dtype, dev, sms)  # the configs tuned before compete too
    extra = sample_test_tuning_configs(shape.lc, ComputeConfig(gemm_type="dense"),
                                       sample_size=samples) if samples else []
    result = {}
    for m in ms:
        heur = dict(get_heuristics_config(shape.lc, shape_m=m, device=dev))
        timed = _tune_m(shape, m, heur, cached.get(m), extra, search, sms)
        if not timed:
            log(f"    M={m}: no candidate ran; kept humming's heuristic")
            continue
        best_s, (best_us, _) = min(timed.items(), key=lambda kv: kv[1][0])
        h_us = timed.get(config_string(on_sms(heur, sms)), (None,))[0]
        c_us = timed.get(config_string(on_sms(cached[m], sms)), (None,))[0] if m in cached else None
        result[m] = {"config": json.loads(best_s), "us": best_us, "heuristic_us": h_us,
                     "cached_us": c_us, "timed": len(timed)}
        log(f"  {gemm.kind} {n}x{k} M={m}: best {best_us:.1f} us (heuristic "
            f"{h_us if h_us is None else round(h_us, 1)}, tuned before "
            f"{c_us if c_us is None else round(c_us, 1)} us) of {len(timed)}: {best_s}")
    if shape.errors:
        log(f"  {gemm.kind} {n}x{k}: {len(shape.errors)} candidates failed to compile, e.g. "
            f"{shape.errors[0]}")
    if result:
        _store(cache_path(dev), _key(gemm.kind, n, k, dtype),
               {f"{m}@{sms}" if sms else m: r["config"] for m, r in result.items()},
               {"gpu": torch.cuda.get_device_name(dev)})
    return result


def main() -> None:  # pragma: no cover - GPU only
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="7b,32b")
    ap.add_argument("--formats", default="nvfp4,mxfp4")
    ap.add_argument("--layouts", default="ct,bf16_scales",
                    help="humming layouts to tune (ct: QuantLinear's; bf16_scales: the rollout "
                         "engine's default, nvfp4 only)")
    ap.add_argument("--ms", default="1,32,64,128")
    ap.add_argument("--search", default="near", choices=("near", "wide"),
                    help="near: the heuristic's neighbours; wide: also tiles, and the fastest "
                         "tiles' variations (see the module docstring)")
    ap.add_argument("--samples", type=int, default=0, help="extra candidates from humming's sampler")
    ap.add_argument("--only", default=None,
                    help="tune only these layers of the models (of qkv,o,gate_up,down)")
    ap.add_argument("--budget-s", type=float, default=600.0,
                    help="stop after this long (shapes not started are skipped, candidates still "
                         "compiling are dropped)")
    ap.add_argument("--shape-budget-s", type=float, default=float("inf"),
                    help="at most this long for one shape and layout (within --budget-s)")
    ap.add_argument("--sms", type=int, default=None, help="tune for at most this many multi"
                    "processors (the GEMM beside the rollout's fused LoRA: all but lora_sms)")
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
                             deadline=min(t0 + args.budget_s,
                                          time.perf_counter() + args.shape_budget_s),
                             layout=layout, search=args.search, sms=args.sms)
            report.append({"fmt": fmt, "layout": layout, "n": n, "k": k, "search": args.search,
                           "sms": args.sms,
                           **{str(m): r for m, r in res.items()}})
            if args.json:
                Path(args.json).write_text(json.dumps({"cache": str(cache_path()),
                                                       "shapes": report}, indent=1))
    print(f"tuning file: {cache_path()}", flush=True)


if __name__ == "__main__":  # pragma: no cover
    main()
