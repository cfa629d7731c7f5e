"""The L2 prefetch plan of the fast engine's decode step (:mod:`qerl.rollout.fast.prefetch`):
which bytes are requested where, in which chunks, and the kernel's PTX for sm_90. (That the
prefetch leaves the rollout unchanged is a GPU test in test_fast_engine.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qerl.rollout.fast import prefetch as P


def test_chunks_cover_each_region_in_aligned_requests() -> None:
    reqs = P.chunks([(1000, 40_000), (1 << 20, 0), (2 << 20, 32)], chunk=16384)
    # region 1: [992, 41008) in 16-byte units, cut at 16 KiB; region 2 empty; region 3 one request
    assert reqs == [(992, 16384), (992 + 16384, 16384), (992 + 32768, 41008 - 992 - 32768),
                    (2 << 20, 32)]
    assert all(a % P.ALIGN == 0 and n % P.ALIGN == 0 and 0 < n <= 16384 for a, n in reqs)
    for bad in (0, 100, -16):
        with pytest.raises(ValueError, match="chunk must be a positive multiple of 16"):
            P.chunks([(0, 64)], chunk=bad)


def test_tensor_regions_are_pointers_and_bytes() -> None:
    a = torch.zeros(10, dtype=torch.bfloat16)
    b = torch.zeros(0)
    c = torch.zeros(3, 4, dtype=torch.uint8)
    assert P.tensor_regions([a, b, c]) == [(a.data_ptr(), 20), (c.data_ptr(), 12)]


class _Gemm:
    """A group's GEMM as the planner sees it: the tensors it reads at some row counts."""

    def __init__(self, nbytes: int, max_rows: int = 64) -> None:
        self.t = torch.zeros(nbytes, dtype=torch.uint8)
        self.max_rows = max_rows

    def prefetch_tensors(self, rows: int) -> list[torch.Tensor]:
        return [self.t] if rows <= self.max_rows else []


def _group(rank: int = 0, n: int = 64):
    """A plan group as the planner sees it: its LoRA rank and stacked adapter weights."""
    if not rank:
        return SimpleNamespace(r_total=0, a_cat=None, b_full=None)
    return SimpleNamespace(r_total=rank, a_cat=torch.zeros(rank, 32), b_full=torch.zeros(n, rank))


def _layers(n: int, qkv_bytes: int = 4096, o_bytes: int = 2048, rank: int = 0):
    layers, gemms = [], {}
    for _ in range(n):
        lay = SimpleNamespace(qkv=_group(rank), o=_group(rank), gu=_group(rank), down=_group(rank))
        gemms[id(lay.qkv)], gemms[id(lay.o)] = _Gemm(qkv_bytes), _Gemm(o_bytes)
        gemms[id(lay.gu)], gemms[id(lay.down)] = _Gemm(1 << 20), _Gemm(1 << 20)
        layers.append(lay)
    return layers, gemms


def _region(gemms, group):
    t = gemms[id(group)].t
    return [(t.data_ptr(), t.numel())]


def _lora(group):
    return [(group.a_cat.data_ptr(), group.a_cat.numel() * 4),
            (group.b_full.data_ptr(), group.b_full.numel() * 4)]


def test_plan_o_prefetches_each_layers_o_before_its_attention() -> None:
    layers, gemms = _layers(3)
    plan = P.plan_prefetch(layers, gemms, rows=8, mode="o", max_bytes=1 << 16)
    assert plan == {("attn", i): _region(gemms, lay.o) for i, lay in enumerate(layers)}
    assert P.plan_prefetch(layers, gemms, rows=8, mode="off", max_bytes=1 << 16) == {}


def test_plan_o_qkv_adds_the_next_layers_qkv_before_down_and_layer0_after_the_head() -> None:
    layers, gemms = _layers(3)
    plan = P.plan_prefetch(layers, gemms, rows=8, mode="o+qkv", max_bytes=1 << 16)
    want = {("attn", i): _region(gemms, lay.o) for i, lay in enumerate(layers)}
    want |= {("down", 0): _region(gemms, layers[1].qkv), ("down", 1): _region(gemms, layers[2].qkv),
             ("head", 0): _region(gemms, layers[0].qkv)}
    assert plan == want  # no ("down", 2): the last layer's next q/k/v is the next step's


def test_plan_with_lora_adds_each_groups_adapters_beside_its_weights() -> None:
    layers, gemms = _layers(2, rank=4)
    plan = P.plan_prefetch(layers, gemms, rows=8, mode="o+qkv+lora", max_bytes=1 << 16)
    l0, l1 = layers
    assert plan == {
        ("attn", 0): _region(gemms, l0.o) + _lora(l0.o),
        ("attn", 1): _region(gemms, l1.o) + _lora(l1.o),
        ("gu", 0): _lora(l0.gu), ("gu", 1): _lora(l1.gu),  # gate/up's weights: over the limit
        ("down", 0): _region(gemms, l1.qkv) + _lora(l1.qkv) + _lora(l0.down),
        ("down", 1): _lora(l1.down),
        ("head", 0): _region(gemms, l0.qkv) + _lora(l0.qkv)}
    # without "+lora" the adapters are never requested
    plain = P.plan_prefetch(layers, gemms, rows=8, mode="o+qkv", max_bytes=1 << 16)
    assert plain[("attn", 0)] == _region(gemms, l0.o) and ("gu", 0) not in plain


def test_plan_leaves_out_groups_too_big_for_l2_or_not_run_by_a_prefetchable_gemm() -> None:
    layers, gemms = _layers(2, qkv_bytes=5000, o_bytes=3000)
    plan = P.plan_prefetch(layers, gemms, rows=8, mode="o+qkv", max_bytes=4096)
    assert set(plan) == {("attn", 0), ("attn", 1)}  # q/k/v over the limit
    assert P.plan_prefetch(layers, gemms, rows=128, mode="o+qkv", max_bytes=1 << 16) == {}
    del gemms[id(layers[0].o)]  # a group without a GEMM of its own (the CPU path)
    assert set(P.plan_prefetch(layers, gemms, rows=8, mode="o", max_bytes=1 << 16)) == {("attn", 1)}
    with pytest.raises(ValueError, match="l2_prefetch must be off, o, o\\+qkv or o\\+qkv\\+lora, got 'gu'"):
        P.plan_prefetch(layers, gemms, rows=8, mode="gu", max_bytes=1 << 16)


def test_prefetch_table_holds_the_requests() -> None:
    t = torch.zeros(40_000, dtype=torch.uint8)
    pf = P.L2Prefetch([(t.data_ptr(), t.numel())], torch.device("cpu"), policy="evict_last")
    reqs = P.chunks([(t.data_ptr(), t.numel())])
    assert pf.n_req == len(reqs) == 3 and pf.nbytes == sum(n for _, n in reqs) >= 40_000
    assert pf.table.dtype == torch.int64 and pf.table.tolist() == [list(r) for r in reqs]
    empty = P.L2Prefetch([], torch.device("cpu"))
    assert empty.n_req == 0 and empty.nbytes == 0
    empty.launch()  # nothing to issue: no kernel, no error on a machine without Triton
    with pytest.raises(ValueError, match="l2_prefetch_policy must be normal or evict_last"):
        P.L2Prefetch([], torch.device("cpu"), policy="evict_first")


def test_resolve_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda", 0)
    assert P.resolve_mode("off", torch.device("cpu"), "torch") == "off"
    with pytest.raises(ValueError, match=r"l2_prefetch='o\+qkv' needs the triton backend"):
        P.resolve_mode("o+qkv", torch.device("cpu"), "torch")
    monkeypatch.setattr(P, "prefetch_supported", lambda d: d.type == "cuda")
    assert P.resolve_mode("o", cuda, "triton") == "o"
    with pytest.raises(ValueError, match="backend torch"):
        P.resolve_mode("o", cuda, "torch")


def test_prefetch_unsupported_off_a_hopper_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not P.prefetch_supported(torch.device("cpu"))
    monkeypatch.setattr(P, "HAS_TRITON", True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cap = {"v": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["v"])
    assert P.prefetch_supported(torch.device("cuda", 0))
    cap["v"] = (8, 9)
    assert not P.prefetch_supported(torch.device("cuda", 0))
    cap["v"] = (9, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not P.prefetch_supported(torch.device("cuda", 0))


def test_prefetch_kernel_compiles_for_hopper() -> None:
    """PTX for sm_90 with the real compiler (no GPU needed): one bulk L2 prefetch per thread,
    under a predicate (the padding requests are empty), with the evict-last policy when asked;
    with PDL the next kernel may launch before this one waits for the one before it."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from qerl.rollout.fast import prefetch as P
sig = {"table_ptr": "*i64", "n_req": "i32", "NT": "constexpr", "EVICT_LAST": "constexpr", "PDL": "constexpr"}
for last in (False, True):
    for pdl in (False, True):
        src = ASTSource(fn=P._l2_prefetch_kernel, signature=sig,
                        constexprs={"NT": 32, "EVICT_LAST": last, "PDL": pdl})
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
        lines = [ln.strip() for ln in k.asm["ptx"].splitlines() if not ln.strip().startswith(".loc")]
        body = "\\n".join(lines)
        hint = ".L2::cache_hint" if last else ""
        assert f"@p cp.async.bulk.prefetch.L2.global{hint} [" in body, body
        assert ("createpolicy.fractional.L2::evict_last" in body) == last
        if pdl:
            assert body.index("griddepcontrol.launch_dependents") < body.index("griddepcontrol.wait")
            assert body.index("cp.async.bulk.prefetch") < body.index("griddepcontrol.launch_dependents")
        else:
            assert "griddepcontrol" not in body
print("ok")
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
