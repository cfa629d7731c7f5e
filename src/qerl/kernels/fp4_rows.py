"""Our FP4 GEMM for decode waves of 9 to 64 rows on Hopper: ``fp4_rows.cu``.

At 32 and 64 rows humming's decode GEMMs are bound per multiprocessor, not by the DRAM (runs
55-58 of docs/benchmarks.md: few warps in flight, a third of the multiprocessors idle at the
end), which caps the H200's 32B B=32 and 7B B=64 rows. This kernel keeps the GEMV's way of
streaming the stored codes straight into registers (:mod:`qerl.kernels.fp4_gemv`) but lets the
warps of a CTA split the output features and share one staged copy of the activations, so the
activations cost L2 traffic in proportion to the CTA's features, not to each warp's; K is split
over CTAs where the features alone give too few (the down projections).

:class:`Fp4Rows` runs on the tensors an :class:`qerl.kernels.fp4_gemv.Fp4Gemv` reads in place
(its weights, scales and per-column factors), so a group's GEMV handles every decode width with
no second copy: :meth:`qerl.kernels.fp4_gemv.Fp4Gemv.__call__` hands waves above
:data:`qerl.kernels.fp4_gemv.MAX_M` rows to it.
"""

from __future__ import annotations

import torch

from qerl.kernels.fp4_gemv_build import ROWS_ARG_TYPES, launch, loaded

__all__ = ["MAX_ROWS", "MIN_ROWS", "Fp4Rows", "default_split_k", "default_variant", "row_tiles"]

MIN_ROWS, MAX_ROWS = 9, 64


def row_tiles(m: int) -> int:
    """Tiles of 8 rows a variant is compiled for at ``m`` rows: 2, 4 or 8 (16, 32, 64 rows)."""
    if not MIN_ROWS <= m <= MAX_ROWS:
        raise ValueError(f"Fp4Rows: {m} rows, not in {MIN_ROWS}..{MAX_ROWS}")
    return max(2, 1 << (-(-m // 8) - 1).bit_length())


def default_variant(n: int, k: int, m: int) -> tuple[int, int, int]:
    """``(warps a CTA, tiles of 16 features a warp, steps of weights a warp has in flight)``:
    4 warps of 2 tiles (128 features a CTA: its activations cost half the L2 bytes of its weights
    at 32 rows) where the registers allow it, one tile at 64 rows (2 tiles need 231 registers a
    thread there, two CTAs a multiprocessor; one tile 153, three)."""
    return (4, 1, 2) if row_tiles(m) == 8 else (4, 2, 2)


def default_split_k(n: int, k: int, variant: tuple[int, int, int], sms: int = 132) -> int:
    """CTAs that split each block's K: 1 where the blocks of ``variant`` alone number at least
    the multiprocessors, else enough for about two items a multiprocessor (the 7B and 32B down,
    q/k/v and o projections), each part at least 4 steps of 128 inputs."""
    blocks = -(-n // (16 * variant[0] * variant[1]))
    if blocks >= sms:
        return 1
    return max(1, min(16, -(-2 * sms // blocks), k // 128 // 4))


class Fp4Rows:
    """``y = x @ W^T`` for ``x [M, K]`` (bf16, ``MIN_ROWS <= M <= MAX_ROWS``) and the FP4
    weights of ``gemv`` (read in place, as it reads them).

    Args:
        gemv: the :class:`qerl.kernels.fp4_gemv.Fp4Gemv` whose tensors, column factors and MXFP4
            exponent offset this kernel uses.
        variant: ``(warps, tiles a warp, steps in flight)``; :func:`default_variant` if None.
        split_k: CTAs a block's K is split over (1..16); :func:`default_split_k` if None.
    """

    def __init__(self, gemv, variant: tuple[int, int, int] | None = None,
                 split_k: int | None = None) -> None:
        if variant is not None and not (
                len(variant) == 3 and all(type(v) is int for v in variant)
                and variant[0] in (2, 4, 8) and variant[1] in (1, 2, 4) and 1 <= variant[2] <= 4):
            raise ValueError(f"Fp4Rows: variant must be (warps 2/4/8, tiles a warp 1/2/4, steps "
                             f"in flight 1..4), got {variant}")
        if split_k is not None and (type(split_k) is not int or not 1 <= split_k <= 16):
            raise ValueError(f"Fp4Rows: split_k must be an int in 1..16 or None, got {split_k!r}")
        self.gemv, self.variant, self.split_k = gemv, variant, split_k
        self._split: tuple[torch.Tensor, torch.Tensor] | None = None
        self._functions: dict[tuple, tuple] = {}  # the process-wide lookup once per variant

    def plan(self, m: int) -> tuple[tuple[int, int, int], int]:
        """The variant and split of K used at ``m`` rows."""
        gv = self.gemv
        variant = self.variant or default_variant(gv.n, gv.k, m)
        ks = self.split_k or default_split_k(gv.n, gv.k, variant, gv._sms)
        return variant, min(ks, gv.k // 128)

    def nbytes(self) -> int:
        """Bytes of the split's workspace and counters (none until a split launch ran)."""
        return sum(t.numel() * t.element_size() for t in self._split or ())

    def __call__(self, x: torch.Tensor, out: torch.Tensor, pdl: bool = False,
                 sms: int | None = None) -> torch.Tensor:
        """``x [M, K]`` (contiguous, 16-byte aligned bf16; checked by the caller) into ``out``
        ``[M, N]`` (contiguous columns); ``pdl`` and ``sms`` as for the GEMV."""
        gv, m = self.gemv, int(x.shape[0])
        nt = row_tiles(m)
        (warps, ft, unr), ks = self.plan(m)
        defines = (("MX", int(gv.fmt == "mxfp4")), ("NWARPS", warps), ("FT", ft), ("NT", nt),
                   ("UNR", unr), ("SPLITK", int(ks > 1)))
        if defines not in self._functions:
            self._functions[defines] = loaded("fp4_rows.cu", "fp4_rows", defines,
                                              x.device.index or 0, warps * 32)
        fn, per_sm = self._functions[defines]
        blocks = -(-gv.n // (16 * warps * ft))
        split = (0, 0)
        if ks > 1:
            if self._split is None:  # zeros between launches (the last CTA of a block leaves them)
                self._split = (torch.zeros(gv.n * MAX_ROWS, device=gv.device),  # any variant's
                               torch.zeros(-(-gv.n // 32), dtype=torch.int32, device=gv.device))
            split = (self._split[0].data_ptr(), self._split[1].data_ptr())
        items = blocks * ks
        grid = items if sms is None else min(items, max(1, sms) * per_sm)
        w = gv._weight_args  # the three (weight, scale) pointers, end0, end1, column factors
        launch(fn, grid, warps * 32, x.device, pdl,
               (x.data_ptr(), *w, out.data_ptr(), m, gv.n, gv.k, out.stride(0), gv.mx_bias,
                *split, ks), ROWS_ARG_TYPES)
        return out
