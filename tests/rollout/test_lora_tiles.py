"""The fused LoRA kernel's launch geometry (pure Python: no Triton needed)."""

from __future__ import annotations

import torch

from qerl.rollout.fast.lora import BLOCK_N, LoraLaunch, lora_torch, tile_rank_starts


def test_tiles_inside_one_member_read_only_that_members_rank_slice() -> None:
    # 7B q/k/v: 3584 + 512 + 512 columns, r = 32 each; 128-column tiles never straddle
    firsts, window = tile_rank_starts([3584, 512, 512], [32, 32, 32], 128)
    assert window == 32
    assert firsts == [0] * 28 + [32] * 4 + [64] * 4


def test_a_straddling_tile_makes_every_tile_read_the_whole_rank() -> None:
    firsts, window = tile_rank_starts([200, 56], [4, 12], 128)
    assert firsts == [0, 0] and window == 16  # np2(16), at least 16 (a dot's smallest side)
    firsts, window = tile_rank_starts([100, 100, 100], [24, 24, 24], 128)
    assert firsts == [0, 0, 0] and window == 128


def test_window_is_the_largest_member_rank_rounded_up() -> None:
    firsts, window = tile_rank_starts([256, 128], [8, 40], 128)
    assert firsts == [0, 0, 8] and window == 64


def test_launch_gives_each_shrink_program_one_slice_of_128_or_256_features() -> None:
    for in_f, k_per, split in ((3584, 128, 28), (5120, 128, 40), (18944, 256, 74), (27648, 256, 108),
                               (64, 128, 1)):
        lau = LoraLaunch([BLOCK_N * 2], [16], in_f, torch.device("cpu"))
        assert (lau.k_per, lau.split) == (k_per, split), in_f
        assert (lau.split - 1) * lau.k_per < in_f <= lau.split * lau.k_per
    lau = LoraLaunch([3584, 512, 512], [32, 32, 32], 3584, torch.device("cpu"))
    assert lau.n_tiles == 36 and lau.r0.dtype == torch.int32 and lau.acc_numel(64) == 2 * 64 * 96 and lau.programs() == 28 + 36


def test_reference_is_the_two_gemm_product() -> None:
    g = torch.Generator().manual_seed(0)
    x, a, b = torch.randn(3, 10, generator=g), torch.randn(4, 10, generator=g), torch.randn(6, 4, generator=g)
    torch.testing.assert_close(lora_torch(x, a, b), x @ a.t() @ b.t())
    out = torch.empty(3, 6)
    assert lora_torch(x, a, b, out=out) is out
    torch.testing.assert_close(out, x @ a.t() @ b.t())
