"""The LoRA of a group inside its FP4 GEMV launch (:class:`qerl.kernels.fp4_gemv.Fp4Gemv` with
``lora=(state, a_cat, b_full)``): ``y = x W^T + round_bf16(x a_cat^T) b_full^T`` in one launch,
so decode at one row pays no LoRA launch of its own. The kernel's side (tickets, the shrink
items the first CTAs do, the expand in the tiles' epilogue) is described in ``fp4_gemv.cu``; this
module holds what persists between launches and checks what a launch is given.

Not the engine's default (``FastEngine(lora_kernel="gemv")`` turns it on): on the H100 the fused
LoRA kernel of :mod:`qerl.rollout.fast.lora` beside the GEMV costs less, 7B B=1 NVFP4 + LoRA
r=32 3.12 against 3.22 ms a step (run 83 of docs/benchmarks.md): every CTA's epilogue waits for
the shrink and reads its rows, which at the gate/up (two waves of CTAs) holds the slots longer."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qerl.kernels.fp4_gemv import MAX_M, Fp4Gemv

__all__ = ["MAX_LORA_RANK", "SHRINK_K", "GemvLora", "lora_fits", "shrink_items"]

SHRINK_K = 128  # inputs a shrink item covers (one step of the GEMV's warps)
MAX_LORA_RANK = 128  # the largest rank of a member (the .cu file's LORA window)


def lora_fits(ranks: Sequence[int]) -> bool:
    """Whether :class:`GemvLora` takes members of these LoRA ranks (0: a member without
    adapters): none above :data:`MAX_LORA_RANK`, at least one not 0."""
    return any(ranks) and all(r >= 0 for r in ranks) and max(ranks) <= MAX_LORA_RANK


def shrink_items(k: int, r_total: int, warps: int) -> int:
    """The shrink items of a launch (each done by one of the first CTAs to start, before its own
    tiles): one a 128-input slice of K and block of ``warps * 16`` ranks (the ``.cu`` file's
    LORA_RB: a thread loads 8 inputs of 8 ranks)."""
    return -(-k // SHRINK_K) * -(-r_total // (warps * 16))


class GemvLora:
    """What the LoRA inside one :class:`Fp4Gemv`'s launch keeps between launches: a float32
    accumulator of two ``[MAX_M, R]`` buffers (used by alternate launches) and two int64
    counters (tickets handed out, shrink items done), zeros at first and then only ever passed to
    launches of this GEMV, one at a time (one stream): each launch leaves them as the next needs
    them (the protocol is in the ``.cu`` file).

    Args:
        gemv: the GEMV it runs in.
        ranks: the LoRA rank of each of its weights (see :func:`lora_fits`); ``b_full``'s columns
            are the members' rank slices in this order, block diagonal (a member's rows are zero
            outside its slice: the kernel reads ``window`` columns from the slice's start).
    """

    def __init__(self, gemv: Fp4Gemv, ranks: Sequence[int]) -> None:
        ranks = [int(r) for r in ranks]
        if len(ranks) != len(gemv.n_sizes) or not lora_fits(ranks):
            raise ValueError(f"GemvLora: one rank a weight ({len(gemv.n_sizes)}), none above "
                             f"{MAX_LORA_RANK} or negative, not all 0; got {ranks}")
        self.ranks, self.r_total = ranks, sum(ranks)
        self.window = -(-max(ranks) // 8) * 8  # the kernel's LORA: ranks read a member's row
        starts = [sum(ranks[:i]) for i in range(len(ranks))]  # of b_full: its rank slice first
        self.starts = starts + starts[-1:] * (3 - len(starts))
        self.split = shrink_items(gemv.k, self.r_total, gemv.variant[0])
        self.acc = torch.zeros(2 * MAX_M * self.r_total, device=gemv.device)
        self.counters = torch.zeros(2, dtype=torch.int64, device=gemv.device)
        self._gemv = gemv

    def check(self, gemv: Fp4Gemv, a_cat: torch.Tensor, b_full: torch.Tensor) -> int:
        """The rank window the kernel is compiled for, or a ValueError naming the bad tensor."""
        if gemv is not self._gemv:
            raise ValueError("GemvLora: this state belongs to another Fp4Gemv (its counters "
                             "count that one's launches)")
        for name, t, shape in (("a_cat", a_cat, (self.r_total, gemv.k)),
                               ("b_full", b_full, (gemv.n, self.r_total))):
            if (t.dtype != torch.bfloat16 or tuple(t.shape) != shape or not t.is_contiguous()
                    or t.device != gemv.device or (name == "a_cat" and t.data_ptr() % 16)):
                raise ValueError(f"GemvLora: {name} must be contiguous bf16 {list(shape)} on "
                                 f"{gemv.device}" + (", 16-byte aligned" if name == "a_cat" else "")
                                 + f", got {t.dtype} {list(t.shape)} on {t.device}")
        return self.window

    def args(self, a_cat: torch.Tensor, b_full: torch.Tensor) -> tuple:
        """The kernel's LoRA arguments."""
        return (a_cat.data_ptr(), b_full.data_ptr(), self.acc.data_ptr(),
                self.counters.data_ptr(), self.r_total, self.split, *self.starts)
