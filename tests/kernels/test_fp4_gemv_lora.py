"""The LoRA inside the FP4 GEMV's launch (``qerl.kernels.fp4_gemv_lora``): what it keeps and the
errors it raises (CPU); the kernel against the float32 reference of base GEMM + two-GEMM LoRA
(the shrink rounded to bf16) over several launches on the same counters, stacked members of
different ranks (one without adapters), both formats, with PDL and in a CUDA graph (GPU, sm_90+).
"""

from __future__ import annotations

import pytest
import torch

from qerl.kernels import fp4_gemv
from qerl.kernels.fp4_gemv import Fp4Gemv
from qerl.kernels.fp4_gemv_lora import MAX_LORA_RANK, GemvLora, lora_fits, shrink_items

from .test_fp4_gemv import TOL, _gpu_ok, _members, _quant, _ref, _rel

gpu = pytest.mark.skipif(not _gpu_ok(), reason="needs a CUDA GPU of sm_90+ and cuda-bindings")


def _adapters(sizes: list[int], ranks: list[int], k: int, device="cpu", seed: int = 0):
    """``a_cat [R, K]`` and block-diagonal ``b_full [N, R]`` (bf16), as the plan builds them."""
    g = torch.Generator(device=device).manual_seed(seed)
    r_total = sum(ranks)
    a = (torch.randn(r_total, k, device=device, generator=g) * 0.05).bfloat16()
    b = torch.zeros(sum(sizes), r_total, device=device)
    row = col = 0
    for n, r in zip(sizes, ranks, strict=True):
        b[row:row + n, col:col + r] = torch.randn(n, r, device=device, generator=g) * 0.1
        row, col = row + n, col + r
    return a, b.bfloat16()


def _lora_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The two-GEMM path: the shrink rounded to bf16, then the expand, in float32."""
    return (x.float() @ a.float().t()).bfloat16().float() @ b.float().t()


def test_which_ranks_fit() -> None:
    assert lora_fits([32, 32, 32]) and lora_fits([4, 4, 4]) and lora_fits([16, 0])
    assert lora_fits([MAX_LORA_RANK])
    assert not lora_fits([0, 0, 0])  # nothing to add
    assert not lora_fits([MAX_LORA_RANK + 8, 8])
    assert not lora_fits([8, -8])


def test_shrink_items_cover_every_slice_and_rank_block() -> None:
    assert shrink_items(3584, 96, 8) == 28  # 7B q/k/v at r = 32: 28 slices, 128 ranks a block
    assert shrink_items(3584, 96, 4) == 56  # 4 warps: 64 ranks a block
    assert shrink_items(1280, 200, 8) == 20 and shrink_items(128, 1, 1) == 1


def test_shared_memory_sizes_and_fitting() -> None:
    # the static shared memory ptxas reported for these variants (nvcc -Xptxas -v, sm_90):
    # (warps, steps, tiles, rows, LoRA window) -> bytes
    ptxas = {(4, 1, 2, 1, 32): 7688, (8, 4, 1, 1, 32): 13768, (8, 2, 1, 1, 32): 9672,
             (8, 4, 1, 1, 0): 12288, (4, 2, 2, 4, 16): 14600}
    for args, nbytes in ptxas.items():
        assert fp4_gemv._smem_bytes(*args) == nbytes, args
    assert fp4_gemv._fitting((16, 2, 0, 2), 3) == (16, 2, 0, 2)  # no LoRA: 48 KiB exactly fits
    assert fp4_gemv._fitting((8, 4, 0, 1), 1, 32) == (8, 4, 0, 1)  # the 7B o with its LoRA
    assert fp4_gemv._fitting((8, 2, 0, 2), 8, 128) == (8, 1, 0, 2)  # one step a batch fits
    with pytest.raises(ValueError, match="more than 48 KiB"):
        fp4_gemv._fitting((16, 1, 0, 2), 8, 128)


def test_state_windows_and_buffers() -> None:
    ts = [_quant(64, 512, "nvfp4"), _quant(32, 512, "nvfp4"), _quant(32, 512, "nvfp4")]
    g = Fp4Gemv("nvfp4", [m for t in ts for m in _members(t)])
    st = GemvLora(g, [12, 4, 4])
    assert (st.r_total, st.window, st.starts) == (20, 16, [0, 12, 16])
    assert g.variant[0] == 8 and st.split == shrink_items(512, 20, 8) == 4  # 4 slices, 1 block
    assert st.acc.shape == (2 * 8 * 20,) and not st.acc.any()  # two [MAX_M, R] buffers, zeros
    assert st.counters.tolist() == [0, 0]
    two = GemvLora(Fp4Gemv("nvfp4", _members(ts[0]) + _members(ts[1])), [0, 8])
    assert (two.window, two.starts) == (8, [0, 0, 0])  # a member without adapters: rank 0
    a, b = _adapters([64, 32, 32], [12, 4, 4], 512)
    assert st.check(g, a, b) == 16
    args = st.args(a, b)
    assert args[:4] == (a.data_ptr(), b.data_ptr(), st.acc.data_ptr(), st.counters.data_ptr())
    assert args[4:] == (20, 4, 0, 12, 16)


def test_bad_state_and_tensors_raise_naming_them() -> None:
    ts = [_quant(64, 512, "nvfp4"), _quant(32, 512, "nvfp4")]
    g = Fp4Gemv("nvfp4", [m for t in ts for m in _members(t)])
    with pytest.raises(ValueError, match="one rank a weight"):
        GemvLora(g, [8])
    with pytest.raises(ValueError, match="not all 0"):
        GemvLora(g, [0, 0])
    with pytest.raises(ValueError, match="none above"):
        GemvLora(g, [8, MAX_LORA_RANK + 1])
    st = GemvLora(g, [8, 8])
    a, b = _adapters([64, 32], [8, 8], 512)
    with pytest.raises(ValueError, match="another Fp4Gemv"):
        st.check(Fp4Gemv("nvfp4", [m for t in ts for m in _members(t)]), a, b)
    with pytest.raises(ValueError, match=r"a_cat must be contiguous bf16 \[16, 512\]"):
        st.check(g, a[:8], b)
    with pytest.raises(ValueError, match="a_cat"):
        st.check(g, a.float(), b)
    with pytest.raises(ValueError, match=r"b_full must be contiguous bf16 \[96, 16\]"):
        st.check(g, a, b.t().contiguous().t())
    # the GEMV checks before any launch: a bad LoRA tensor raises on the CPU too
    with pytest.raises(ValueError, match="b_full"):
        g(torch.zeros(1, 512, dtype=torch.bfloat16), lora=(st, a, b[:, :8].contiguous()))


def test_engine_lora_kernel_option() -> None:
    from qerl.rollout.fast.engine import FastEngine

    assert FastEngine(lora_kernel="gemv").lora_kernel == "gemv"
    with pytest.raises(ValueError, match="lora_kernel must be fused, gemv or cublas"):
        FastEngine(lora_kernel="standalone")


# -- the CUDA kernel -----------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("ranks", [[32, 32, 32], [16, 8, 8], [4, 0, 12]])
@pytest.mark.parametrize("variant,pdl", [(None, False), (None, True), ((4, 1, 0, 2), True),
                                         ((8, 4, 0, 1), False)])
def test_lora_inside_the_launch_against_float32(fmt: str, ranks: list[int], variant,
                                                pdl: bool) -> None:
    """q/k/v-like members (the last not a whole tile), launches of 1, 3, 8, 1 rows on the same
    state: each equals the base GEMM plus the two-GEMM LoRA; after them the counters hold every
    ticket and every shrink, and the buffer the next launch adds into is zeros."""
    k, sizes = 1280, [512, 128, 120]  # 10 slices; 4 warps and rank 96: two rank blocks
    ts = [_quant(n, k, fmt, device="cuda") for n in sizes]
    g = Fp4Gemv(fmt, [m for t in ts for m in _members(t)], variant=variant)
    a, b = _adapters(sizes, ranks, k, device="cuda")
    st = GemvLora(g, ranks)
    launches = [1, 3, 8, 1]
    for i, m in enumerate(launches):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = g(x, pdl=pdl, lora=(st, a, b))
        want = _ref(x, ts, fmt) + _lora_ref(x, a, b)
        assert _rel(y, want) < TOL, (i, m)
        lo = y.float() - _ref(x, ts, fmt)  # the LoRA's share alone, to bf16 and FP4 noise
        assert _rel(lo, _lora_ref(x, a, b)) < 0.2, (i, m)
    torch.cuda.synchronize()
    groups = -(-sum(sizes) // (16 * g.variant[3]))
    assert st.counters.tolist() == [len(launches) * groups, len(launches) * st.split]
    nxt = len(launches) % 2
    assert not st.acc.view(2, -1)[nxt].any()


@gpu
@pytest.mark.parametrize("variant", [(4, 1, 0, 2), (8, 4, 0, 1)])
def test_lora_inside_the_launch_with_more_ctas_than_the_gpu_holds(variant) -> None:
    """A gate/up-like width: more CTAs than fit at once (later ones start as earlier ones
    finish, after the shrink items are done), each adding the same shrink to its tiles."""
    k, sizes, ranks = 256, [16 * 4096, 16 * 4096 + 8], [32, 32]
    ts = [_quant(n, k, "nvfp4", device="cuda") for n in sizes]
    g = Fp4Gemv("nvfp4", [m for t in ts for m in _members(t)], variant=variant)
    a, b = _adapters(sizes, ranks, k, device="cuda")
    st = GemvLora(g, ranks)
    for m in (1, 2, 1):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = g(x, pdl=True, lora=(st, a, b))
        assert _rel(y, _ref(x, ts, "nvfp4") + _lora_ref(x, a, b)) < TOL, m
    torch.cuda.synchronize()
    groups = -(-sum(sizes) // (16 * g.variant[3]))
    assert st.counters.tolist() == [3 * groups, 3 * st.split]


@gpu
def test_lora_inside_the_launch_replays_in_a_cuda_graph() -> None:
    """Captured with PDL behind the writer of its input, back to back with itself: every replay
    adds the LoRA of the new input and of the adapter weights as they are then (updated in place
    between replays, as ``refresh_lora`` does)."""
    k, sizes, ranks = 1024, [640, 256], [16, 16]
    ts = [_quant(n, k, "nvfp4", device="cuda") for n in sizes]
    g = Fp4Gemv("nvfp4", [m for t in ts for m in _members(t)])
    a, b = _adapters(sizes, ranks, k, device="cuda")
    st = GemvLora(g, ranks)
    src = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(src)
    out = torch.empty(1, sum(sizes), device="cuda", dtype=torch.bfloat16)
    out2 = torch.empty_like(out)
    x.copy_(src)
    g(x, out=out, pdl=True, lora=(st, a, b))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.copy_(src)
        x.mul_(2.0)
        g(x, out=out, pdl=True, lora=(st, a, b))
        g(x, out=out2, pdl=True, lora=(st, a, b))  # the same GEMV right after itself
    for seed in range(3):
        src.copy_(torch.randn_like(src))
        a2, b2 = _adapters(sizes, ranks, k, device="cuda", seed=seed + 1)
        a.copy_(a2)
        b.copy_(b2)
        graph.replay()
        torch.cuda.synchronize()
        want = _ref(src * 2.0, ts, "nvfp4") + _lora_ref(src * 2.0, a, b)
        assert _rel(out, want) < TOL and _rel(out2, want) < TOL, seed
    assert st.counters[1].item() == 7 * st.split  # one eager launch and two a replay

