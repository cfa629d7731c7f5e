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
    g._tuned = {1: {"t": 1}, 64: {"t": 64}}
    g._tuning = {}
    assert json.loads(g.tuning_for(1)) == {"t": 1, "use_pdl": False}
    assert json.loads(g.tuning_for(2)) == {"t": 64, "use_pdl": False}
    assert json.loads(g.tuning_for(64)) == {"t": 64, "use_pdl": False}


def test_tuning_sets_use_pdl_per_call_and_keeps_the_tuned_entry() -> None:
    """PDL is part of the kernel humming compiles: each (M, pdl) gets its own config string,
    the tuned entry itself unchanged (a tuned entry that says ``use_pdl`` is overridden)."""
    g = object.__new__(humming_gemm.HummingFp4)
    g._tuned = {64: {"t": 64, "use_pdl": False}}
    g._tuning = {}
    on, off = json.loads(g.tuning_for(8, pdl=True)), json.loads(g.tuning_for(8))
    assert on == {"t": 64, "use_pdl": True} and off == {"t": 64, "use_pdl": False}
    assert g._tuned[64] == {"t": 64, "use_pdl": False}
    assert set(g._tuning) == {(8, True, None), (8, False, None)}
    assert "num_sms" not in on  # no ``sms``: humming's grid as tuned (all multiprocessors)
    # a smaller persistent grid: at most ``sms`` multiprocessors, never more than tuned
    g._tuned = {64: {"t": 64}, 128: {"t": 128, "num_sms": 100}}
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
