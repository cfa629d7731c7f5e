"""The humming tuning file (written atomically, read back per GPU, other humming versions
ignored) and the per-row-count kernel choice, without the library (its version is stubbed)."""

from __future__ import annotations

import enum
import json

import numpy as np
import pytest
import torch

from qerl.kernels import humming_gemm, tuning


@pytest.fixture
def tuning_file(tmp_path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "t.json"
    monkeypatch.setenv(tuning.ENV_VAR, str(path))
    monkeypatch.setattr(tuning, "_humming_version", lambda: "9.9")
    tuning._LOADED.clear()
    yield path
    tuning._LOADED.clear()


def test_store_and_lookup_round_trip(tuning_file) -> None:
    dev = torch.device("cpu")
    assert tuning.lookup("nvfp4", 4608, 3584, torch.bfloat16, dev) == {}
    tuning._store(tuning_file, tuning._key("nvfp4", 4608, 3584, torch.bfloat16),
                  {64: {"block_shape": [64, 128, 128]}, 1: {"block_shape": [16, 64, 256]}},
                  {"gpu": "test"})
    assert not tuning_file.with_suffix(".tmp").exists()
    got = tuning.lookup("nvfp4", 4608, 3584, torch.bfloat16, dev)
    assert got == {1: {"block_shape": [16, 64, 256]}, 64: {"block_shape": [64, 128, 128]}}
    assert tuning.lookup("mxfp4", 4608, 3584, torch.bfloat16, dev) == {}
    tuning._store(tuning_file, tuning._key("mxfp4", 512, 256, torch.bfloat16), {8: {"a": 1}}, {})
    assert tuning.lookup("nvfp4", 4608, 3584, torch.bfloat16, dev)  # earlier entry kept
    # re-tuning one row count keeps the others of the shape (a run with --ms 1 once dropped 32, 64)
    tuning._store(tuning_file, tuning._key("nvfp4", 4608, 3584, torch.bfloat16),
                  {1: {"block_shape": [8, 128, 128]}}, {})
    assert tuning.lookup("nvfp4", 4608, 3584, torch.bfloat16, dev) == {
        1: {"block_shape": [8, 128, 128]}, 64: {"block_shape": [64, 128, 128]}}


def test_configs_tuned_for_fewer_multiprocessors_replace_the_whole_gpu_ones(
        tuning_file, tmp_path, monkeypatch) -> None:
    """``"M@S"`` entries (``tune --sms S``) are what a GEMM limited to ``S`` multiprocessors gets,
    from the shipped file or the user's; the whole-GPU lookup never sees them."""
    key = tuning._key("nvfp4", 4608, 3584, torch.bfloat16)
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"humming": "9.9", "entries": {key: {
        "1": {"s": "1"}, "1@124": {"s": "1@124"}, "64@100": {"s": "64@100"}, "x@1": {"bad": 1}}}}))
    monkeypatch.setattr(tuning, "shipped_path", lambda device=None: shipped)
    tuning._store(tuning_file, key, {64: {"u": "64"}, "32@124": {"u": "32@124"}}, {})
    assert json.loads(tuning_file.read_text())["entries"][key] == {"64": {"u": "64"},
                                                                   "32@124": {"u": "32@124"}}
    dev = torch.device("cuda", 0)  # only names the files: nothing runs on it
    monkeypatch.setattr(tuning, "cache_path", lambda device=None: tuning_file)
    whole = tuning.lookup("nvfp4", 4608, 3584, torch.bfloat16, dev)
    assert whole == {1: {"s": "1"}, 64: {"u": "64"}}
    at124 = tuning.lookup("nvfp4", 4608, 3584, torch.bfloat16, dev, sms=124)
    assert at124 == {1: {"s": "1@124"}, 32: {"u": "32@124"}, 64: {"u": "64"}}
    # the shipped file's config for 100 multiprocessors beats the user's whole-GPU one
    assert tuning.lookup("nvfp4", 4608, 3584, torch.bfloat16, dev, sms=100)[64] == {"s": "64@100"}
    # HummingFp4 asks for the table of the multiprocessors it is given, once each
    g = object.__new__(humming_gemm.HummingFp4)
    g.kind, g.n, g.k, g.dtype, g.device = "nvfp4", 4608, 3584, torch.bfloat16, dev
    g._tuned, g._tuning = {None: whole}, {}
    assert json.loads(g.tuning_for(1)) == {"s": "1", "use_pdl": False}
    assert json.loads(g.tuning_for(1, sms=124)) == {"s": "1@124", "use_pdl": False, "num_sms": 124}
    assert json.loads(g.tuning_for(20, sms=124))["u"] == "32@124"
    assert set(g._tuned) == {None, 124}


def test_other_humming_version_or_bad_file_is_ignored(tuning_file, monkeypatch) -> None:
    tuning._store(tuning_file, tuning._key("nvfp4", 8, 16, torch.bfloat16), {4: {"a": 1}}, {})
    monkeypatch.setattr(tuning, "_humming_version", lambda: "10.0")
    tuning._LOADED.clear()
    assert tuning.lookup("nvfp4", 8, 16, torch.bfloat16, torch.device("cpu")) == {}
    tuning_file.write_text("{not json")
    tuning._LOADED.clear()
    assert tuning.lookup("nvfp4", 8, 16, torch.bfloat16, torch.device("cpu")) == {}


def test_model_gemm_shapes_are_the_engine_groups() -> None:
    assert tuning.model_gemm_shapes("7b") == [("qkv", 4608, 3584), ("o", 3584, 3584),
                                              ("gate_up", 37888, 3584), ("down", 3584, 18944)]


def test_config_string_is_canonical_json() -> None:
    class Mode(enum.Enum):
        WG = "wgmma"

    s = humming_gemm.config_string({"b": (1, 2), "a": Mode.WG, "n": np.int64(3)})
    assert s == '{"a": "wgmma", "b": [1, 2], "n": 3}' and json.loads(s)["n"] == 3
    with pytest.raises(TypeError):
        humming_gemm.config_string({"x": object()})


def test_tuned_interval_choice() -> None:
    """Tuned M values cover (previous tuned M, M]; the row counts a tuned entry serves."""
    g = object.__new__(humming_gemm.HummingFp4)
    g._tuned = {None: {1: {"t": 1}, 64: {"t": 64}}}
    g._tuning = {}
    assert json.loads(g.tuning_for(1)) == {"t": 1, "use_pdl": False}
    assert json.loads(g.tuning_for(2)) == {"t": 64, "use_pdl": False}
    assert json.loads(g.tuning_for(64)) == {"t": 64, "use_pdl": False}


def test_tuning_sets_use_pdl_per_call_and_keeps_the_tuned_entry() -> None:
    """PDL is part of the kernel humming compiles: each (M, pdl) gets its own config string,
    the tuned entry itself unchanged (a tuned entry that says ``use_pdl`` is overridden)."""
    g = object.__new__(humming_gemm.HummingFp4)
    g._tuned = {None: {64: {"t": 64, "use_pdl": False}}}
    g._tuning = {}
    on, off = json.loads(g.tuning_for(8, pdl=True)), json.loads(g.tuning_for(8))
    assert on == {"t": 64, "use_pdl": True} and off == {"t": 64, "use_pdl": False}
    assert g._tuned[None][64] == {"t": 64, "use_pdl": False}
    assert set(g._tuning) == {(8, True, None), (8, False, None)}
    assert "num_sms" not in on  # no ``sms``: humming's grid as tuned (all multiprocessors)
    # a smaller persistent grid: at most ``sms`` multiprocessors, never more than tuned
    g._tuned = {s: {64: {"t": 64}, 128: {"t": 128, "num_sms": 100}} for s in (None, 124, 96)}
    assert json.loads(g.tuning_for(60, sms=124))["num_sms"] == 124
    assert json.loads(g.tuning_for(100, sms=124))["num_sms"] == 100
    assert json.loads(g.tuning_for(100, sms=96))["num_sms"] == 96
    assert json.loads(g.tuning_for(100))["num_sms"] == 100


def test_compile_within_keeps_the_successes_done_by_the_deadline() -> None:
    import threading
    import time

    from qerl.kernels.tune import compile_within

    release, finished = threading.Event(), []

    def compile_one(s: str) -> bool:
        if s == "slow":
            release.wait(10.0)  # a compiler call still running at the deadline
            finished.append(s)
        if s == "boom":
            raise RuntimeError("illegal candidate")
        return s != "illegal"

    got = compile_within(["a", "illegal", "slow", "boom", "b"], compile_one,
                         deadline=time.perf_counter() + 2.0, workers=4)
    assert got == ["a", "b"]  # order kept; failures, errors and the one past the deadline dropped
    assert not finished  # returned at the deadline, without waiting for the slow one
    release.set()
    assert compile_within(["slow", "a"], compile_one, deadline=float("inf"), workers=2) == ["slow", "a"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_us_times_the_captured_calls_not_their_launches() -> None:
    """The tuner's timer: ``fn`` runs once eagerly (warm) and ``reps`` times while a graph is
    captured; the replays do not call Python again."""
    from qerl.kernels.tune import graph_us

    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    calls = []

    def fn():
        calls.append(1)
        return a @ a

    us = graph_us(fn, reps=4, flush_bytes=8 << 20, trials=3)
    assert len(calls) == 1 + 4
    assert 0.0 <= us < 1e5


# -- the shipped tuning files ---------------------------------------------------------------------

@pytest.fixture
def shipped(tmp_path, tuning_file, monkeypatch: pytest.MonkeyPatch):
    """A shipped-files folder for a GPU named ``fake_gpu`` (no CUDA call: the name is stubbed)."""
    folder = tmp_path / "tuned"
    monkeypatch.setattr(tuning, "SHIPPED_DIR", folder)
    monkeypatch.setattr(tuning, "_gpu", lambda device: "fake_gpu")
    monkeypatch.delenv(tuning.SHIPPED_ENV_VAR, raising=False)
    return folder / "humming_tuning_fake_gpu.json"


def test_lookup_reads_the_shipped_file_under_the_users(shipped, tuning_file, monkeypatch) -> None:
    key = tuning._key("nvfp4_bf16_scales", 4608, 3584, torch.bfloat16)
    tuning._store(shipped, key, {1: {"s": 1}, 64: {"s": 64}}, {"gpu": "fake"})
    gpu = torch.device("cuda", 0)  # a CUDA device object: never touched, the GPU name is stubbed
    assert tuning.shipped_path(gpu) == shipped
    assert tuning.lookup("nvfp4_bf16_scales", 4608, 3584, torch.bfloat16, gpu) == {
        1: {"s": 1}, 64: {"s": 64}}  # a fresh install: no user file yet
    tuning._store(tuning_file, key, {64: {"u": 64}, 32: {"u": 32}}, {})
    assert tuning.lookup("nvfp4_bf16_scales", 4608, 3584, torch.bfloat16, gpu) == {
        1: {"s": 1}, 32: {"u": 32}, 64: {"u": 64}}  # the user's row counts win
    monkeypatch.setenv(tuning.SHIPPED_ENV_VAR, "0")
    tuning._LOADED.clear()
    assert tuning.shipped_path(gpu) is None
    assert tuning.lookup("nvfp4_bf16_scales", 4608, 3584, torch.bfloat16, gpu) == {
        32: {"u": 32}, 64: {"u": 64}}
    monkeypatch.delenv(tuning.SHIPPED_ENV_VAR)
    assert tuning.shipped_path(torch.device("cpu")) is None  # no GPU, no shipped file


def test_a_shipped_file_of_another_humming_version_is_ignored(shipped, monkeypatch) -> None:
    tuning._store(shipped, tuning._key("nvfp4", 8, 16, torch.bfloat16), {4: {"a": 1}}, {})
    monkeypatch.setattr(tuning, "_humming_version", lambda: "10.0")
    tuning._LOADED.clear()
    assert tuning.lookup("nvfp4", 8, 16, torch.bfloat16, torch.device("cuda", 0)) == {}


def test_shipped_files_match_the_pinned_humming_and_cover_the_decode_shapes() -> None:
    """Every shipped file is for the humming version ``.[gpu]`` pins (else it would be ignored),
    and holds the rollout engine's layout of every 7B decode GEMM at 1 and 64 rows and every 32B
    one at 1 and 32 (the benchmark's rows)."""
    import re
    from pathlib import Path

    pyproject = (Path(tuning.__file__).parents[3] / "pyproject.toml").read_text()
    pinned = re.search(r'"humming-kernels==([^"]+)"', pyproject).group(1)
    files = sorted(tuning.SHIPPED_DIR.glob("humming_tuning_*.json"))
    assert files, "no shipped tuning file"
    for f in files:
        data = json.loads(f.read_text())
        assert data["humming"] == pinned, f.name
        for model, rows in (("7b", {"1", "64"}), ("32b", {"1", "32"})):
            for _, n, k in tuning.model_gemm_shapes(model):
                entry = data["entries"][tuning._key("nvfp4_bf16_scales", n, k, torch.bfloat16)]
                assert rows <= set(entry), (f.name, n, k)
                for row, cfg in entry.items():
                    m, sms = tuning._row_key(row)  # "M", or "M@S" tuned on S multiprocessors
                    assert m >= 1 and (sms is None or 0 < cfg["num_sms"] <= sms), (f.name, n, k, row)
                    assert cfg["mma_type"] in ("mma", "wgmma")
                    bs, ws = cfg["block_shape"], cfg["warp_shape"]
                    assert len(bs) == len(ws) == 3 and all(b % w == 0 for b, w in zip(bs, ws, strict=True))


# -- the wide search's candidates (pure: no humming needed) ---------------------------------------

HEUR_WGMMA = {"block_shape": [64, 128, 64], "warp_shape": [64, 32, 64], "mma_type": "wgmma",
              "use_tma": True, "use_warp_spec": True, "num_stages": 4, "num_ctas_per_sm": 2,
              "use_stream_k": True, "use_f16_accum": False, "raster_group_m": 1}
HEUR_MMA = {"block_shape": [8, 128, 128], "warp_shape": [8, 64, 32], "mma_type": "mma",
            "use_tma": False, "use_warp_spec": False, "num_stages": 4, "num_ctas_per_sm": 2,
            "use_stream_k": True, "raster_group_m": 1}


@pytest.mark.parametrize(("m", "tile"), [(1, 8), (8, 8), (9, 16), (32, 32), (33, 64), (64, 64),
                                         (100, 128)])
def test_m_tile_is_the_smallest_power_of_two_holding_m(m, tile) -> None:
    from qerl.kernels.tune_space import m_tile

    assert m_tile(m) == tile


def test_tile_candidates_cover_both_mma_kinds_with_their_transfers() -> None:
    from qerl.kernels.tune_space import BLOCK_K, BLOCK_N, WGMMA_ONLY, tile_candidates

    cands = tile_candidates(HEUR_WGMMA, 32)
    assert len(cands) == 2 * len(BLOCK_N) * len(BLOCK_K)
    assert {(c["block_shape"][1], c["block_shape"][2], c["mma_type"]) for c in cands} == {
        (bn, bk, mma) for bn in BLOCK_N for bk in BLOCK_K for mma in ("mma", "wgmma")}
    for c in cands:
        wg = c["mma_type"] == "wgmma"
        assert c["block_shape"][0] == c["warp_shape"][0] == 32  # the M tile holds the 32 rows
        assert c["use_tma"] is wg and c["use_warp_spec"] is wg
        assert c["block_shape"][2] % c["warp_shape"][2] == 0
        assert wg or not set(WGMMA_ONLY) & set(c)  # no wgmma field on an mma kernel
        assert c["num_stages"] == 4 and c["raster_group_m"] == 1  # the rest as the heuristic's


def test_around_changes_one_field_and_only_applicable_ones() -> None:
    from qerl.kernels.tune_space import AROUND, WARP_SPEC_ONLY, WGMMA_ONLY, around

    for base in (HEUR_WGMMA, HEUR_MMA):
        vs = around(base)
        assert vs and len({json.dumps(v, sort_keys=True) for v in vs}) == len(vs)
        for v in vs:
            diff = {k for k in set(v) | set(base) if v.get(k) != base.get(k)}
            assert len(diff) == 1, diff
            (key,) = diff
            assert key == "warp_shape" or v[key] in AROUND[key]
            if base["mma_type"] == "mma":
                assert key not in WGMMA_ONLY and key not in WARP_SPEC_ONLY
        warps = [tuple(v["warp_shape"]) for v in vs if v["warp_shape"] != base["warp_shape"]]
        assert all(base["block_shape"][i] % w[i] == 0 for w in warps for i in range(3))
    assert (32, 32, 64) in [tuple(v["warp_shape"]) for v in around(HEUR_WGMMA)]  # 2 warps on M
    assert {"producer_registers", "multi_cast_size_a", "smem_reuse_mode",
            "output_chunk_rows", "producer_stage_unroll", "consumer_stage_unroll"} <= {
        k for v in around(HEUR_WGMMA) for k in v if k not in HEUR_WGMMA}
    # a stage unroll is only tried below the config's stages (at or above it is the default)
    for base in (HEUR_WGMMA, {**HEUR_WGMMA, "num_stages": 2}):
        unrolls = [v[k] for v in around(base) for k in ("producer_stage_unroll",
                                                         "consumer_stage_unroll") if k in v]
        assert unrolls and all(u < base["num_stages"] for u in unrolls)
    assert not any("producer_stage_unroll" in v for v in around({**HEUR_WGMMA, "num_stages": 1}))


def test_combine_takes_every_change_that_helped() -> None:
    from qerl.kernels.tune_space import combine

    base = dict(HEUR_WGMMA)
    timed = [(9.0, {**base, "num_stages": 6}), (8.0, {**base, "num_stages": 8}),  # same field
             (9.5, {**base, "use_stream_k": False}), (11.0, {**base, "num_ctas_per_sm": 1}),
             (10.0, {**base, "evict_weights_first": True})]  # no faster than the base: left out
    got = combine(base, timed, base_us=10.0)
    assert got == {**base, "num_stages": 8, "use_stream_k": False}
    assert combine(base, timed[:2], base_us=10.0) is None  # one field: stage 2 timed it already
    assert combine(base, timed, base_us=5.0) is None  # nothing helped


def test_wide_search_reaches_the_best_combination_and_drops_wrong_kernels(monkeypatch) -> None:
    """The wide search's stages on a stand-in GEMM whose time is a known function of the config:
    the fastest config needs a tile change (stage 1) and two field changes together (stages 2
    and 3); a candidate whose output is wrong is never chosen, an illegal one never compiled."""
    import types

    from qerl.kernels import tune
    from qerl.kernels.humming_gemm import config_string

    def cost(cfg: dict) -> float:
        return (100.0 - 20 * (cfg["block_shape"][1] == 256) - 5 * (cfg["num_stages"] == 8)
                - 3 * (not cfg["use_stream_k"]) - 50 * cfg.get("evict_weights_first", False))

    x_ref = torch.randn(4, 8)

    class Gemm:
        k, device, dtype = 8, torch.device("cpu"), torch.float32
        last = None

        def __call__(self, x, tuning):
            Gemm.last = json.loads(tuning)
            wrong = Gemm.last.get("evict_weights_first", False)  # the "fastest" kernel is wrong
            return x_ref * (2.0 if wrong else 1.0)

    compiled_strings = []

    def make_shape():
        compiled: dict[str, bool] = {}

        def compile_(strings, must):
            for s in strings:
                if s not in compiled:
                    compiled_strings.append(s)
                    compiled[s] = True

        return types.SimpleNamespace(gemm=Gemm(), log=lambda s: None, compiled=compiled,
                                     legal=lambda c: c["block_shape"][1] != 512,  # humming's checks
                                     compile=compile_)

    monkeypatch.setattr(tune, "graph_us", lambda fn: (fn(), cost(Gemm.last))[1])
    timed = tune._tune_m(make_shape(), 4, dict(HEUR_WGMMA), None, [], "wide")
    best_s, (best_us, best) = min(timed.items(), key=lambda kv: kv[1][0])
    assert best_us == 100 - 20 - 5 - 3
    assert best["block_shape"][1] == 256 and best["num_stages"] == 8 and not best["use_stream_k"]
    assert not any(c.get("evict_weights_first") for _, c in timed.values())  # rejected: wrong
    assert not any(json.loads(s)["block_shape"][1] == 512 for s in compiled_strings)
    assert config_string(HEUR_WGMMA) in timed  # the heuristic is always among the timed
    near = tune._tune_m(make_shape(), 4, dict(HEUR_WGMMA), None, [], "near")
    assert min(u for u, _ in near.values()) > best_us  # the near search alone cannot get there
    # tuned for the multiprocessors left beside the LoRA: every candidate runs on at most that many
    compiled_strings.clear()
    at = tune._tune_m(make_shape(), 4, dict(HEUR_WGMMA), None, [], "wide", sms=124)
    assert compiled_strings and all(json.loads(s)["num_sms"] == 124 for s in compiled_strings)
    assert all(c["num_sms"] == 124 for _, c in at.values()) and min(u for u, _ in at.values()) == best_us
    # a candidate that already asks for fewer (humming's heuristic may) keeps its smaller grid
    few = tune._tune_m(make_shape(), 4, {**HEUR_WGMMA, "num_sms": 100}, None, [], "near", sms=124)
    assert {c["num_sms"] for _, c in few.values()} == {100}


def test_tune_shape_refuses_an_unknown_search_before_any_work() -> None:
    from qerl.kernels.tune import tune_shape

    with pytest.raises(ValueError, match="search must be 'near' or 'wide', got 'widest'"):
        tune_shape("nvfp4", 4608, 3584, [1], search="widest")  # no humming, no GPU needed
    for bad in (0, -8, 12.5):
        with pytest.raises(ValueError, match="sms must be a positive number of multiprocessors"):
            tune_shape("nvfp4", 4608, 3584, [1], search="wide", sms=bad)
