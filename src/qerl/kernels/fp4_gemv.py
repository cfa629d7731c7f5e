"""Our FP4 GEMM for a few rows (decode at ``M <= MAX_M``) on Hopper: ``fp4_gemv.cu``.

At one row humming's smallest tile is 8 rows, and its decode GEMMs are bound by the loads one
multiprocessor keeps in flight (docs/benchmarks.md, runs 55-58), not by the DRAM. This kernel is
written for that case: a CTA takes tiles of 16 output features (one or two at once) and splits K
over its warps, each lane streams 16-byte chunks of the stored compressed-tensors codes straight
into registers, decodes them with a few integer operations per pair of codes and lets the tensor
cores (``mma.m16n8k16``) do the multiply-adds, in fp32 (the layout and the arithmetic are
described in the ``.cu`` file).

:class:`Fp4Gemv` runs one or several FP4 weights that share the input (q/k/v, gate/up) as one
GEMM whose output columns are theirs side by side, reading the stored tensors in place (no copy:
no memory beyond a per-column factor), and applies ``1 / weight_global_scale`` per output column
itself, so its output is the finished ``x @ W^T`` (no ``col_scale`` for the consumer).
With a :class:`qerl.kernels.fp4_gemv_lora.GemvLora`, the group's LoRA runs in the same launch
(``y += (x A^T) B^T``, the shrink rounded to bf16 as the two-GEMM path rounds it): a few CTAs
compute the shrink first and the tiles add the expand before they store, so decode pays no
launch of its own for it. With ``split_k`` above 1, several CTAs share each group's K and meet
in a float32 workspace of the GEMM (a long K with few tiles: the 7B down projection).
The kernel compiles with NVRTC on first use, once per process and variant (``cuda-bindings``
comes with the ``.[gpu]`` extra, which humming-kernels needs too; CUDA builds of torch bring the
NVRTC library). CPU installs never compile it; :func:`supports` says where it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qerl.kernels.fp4_gemv_build import kernel_function, launch
from qerl.quant.formats import FORMATS

__all__ = ["MAX_M", "STEP_K", "Fp4Gemv", "default_split_k", "default_variant", "mx_bias",
           "preferred", "supports"]

MAX_M = 8  # columns of the tensor-core tile the activations occupy
STEP_K = 128  # K a warp covers per step: K must be a multiple


def supports(fmt: str, k: int, m: int, dtype: torch.dtype, device: torch.device | None = None) -> bool:
    """Whether the kernel runs ``m`` rows of bf16 ``dtype`` activations against FP4 weights with
    ``k`` inputs (on ``device``: CUDA of compute capability 9.0 or newer)."""
    if fmt not in ("nvfp4", "mxfp4") or dtype != torch.bfloat16 or not 0 < m <= MAX_M:
        return False
    if k % STEP_K:
        return False
    if device is not None:
        if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
            return False
    return True


def default_variant(n: int, k: int, sms: int = 132) -> tuple[int, int, int, int]:
    """``(warps a CTA, steps a warp loads at once, pipelined, tiles a CTA)`` for an ``n x k``
    weight on a GPU of ``sms`` multiprocessors (see the ``.cu`` file): the fastest at one row of the
    fp4_matmul benchmark's ``gemv`` scans (H100, runs 68 and 74-77 of docs/benchmarks.md). Many
    CTAs (the 7B gate/up's 2,368 tiles) want small ones, one step in flight and two tiles each
    (one load of the activations for both: 35.7 against 36.4 us, and 34.9 against 38.4 on 124
    multiprocessors, run 75); a few hundred want 8 warps, four steps each where the tiles fit two
    CTAs a multiprocessor (the 7B o and down, 224 tiles: 5.6-5.8 against 6.7-7.1 us and 24.3-24.5
    against 25.7-27.2, runs 74-76), else two steps where K is short (q/k/v, 288 tiles: 6.8-8.2
    against 9.3-9.5 with four) and one where it is long. Where K is split over CTAs
    (:func:`default_split_k`), 4 warps of two steps each (the 7B down at one row, four CTAs a
    group: 21.3 us against 31.8 with 8 warps of four steps and humming's 23.6, run 84)."""
    tiles = -(-n // 16)
    if default_split_k(n, k, sms) > 1:
        return 4, 2, 0, 1
    if tiles >= 1024:
        return 4, 1, 0, 2
    if tiles <= 2 * sms:
        return 8, 4, 0, 1
    return (8, 1, 0, 1) if k // STEP_K >= 64 else (8, 2, 0, 1)


def preferred(n: int, k: int, long_k: bool = False) -> bool:
    """Whether the GEMV is the faster kernel for an ``n x k`` weight at one row: not for a long K
    (the 7B down projection, K = 18,944: 23.4 against humming's 21.4 us in run 68 of
    docs/benchmarks.md, where q/k/v, o and gate/up were 11-36 % faster) unless ``long_k`` (K
    split over several CTAs, :func:`default_split_k`: not measured in a rollout yet)."""
    return long_k or k // STEP_K < 64


def default_split_k(n: int, k: int, sms: int = 132) -> int:
    """CTAs that split the K of each group of tiles: 1 (none) where K is short; for a long K with
    few tiles (the 7B down projection: 224 tiles of 16 features, 148 steps of 128 inputs, on 132
    multiprocessors) 4, so that the CTAs are small and many enough to spread evenly (run 84 of
    docs/benchmarks.md: 4 warps a CTA, 2 / 4 / 8 CTAs a group, the scan of the next run)."""
    return 4 if k // STEP_K >= 64 and -(-n // 16) <= 4 * sms else 1


def mx_bias(scale: torch.Tensor) -> int:
    """MXFP4: the exponent offset that maps the largest E8M0 group scale of ``scale`` (NaN codes,
    255, left out: such a group comes out large, not NaN) to the largest binade of float16
    (2^15); groups far below it lose precision in float16 (2^24 below) and flush to zero (2^30)."""
    b = scale.view(torch.uint8)
    return int(b.masked_fill(b == 255, 0).max().item()) - 30


def _column_factor(fmt: str, members, n_sizes: Sequence[int], bias: int, device) -> torch.Tensor:
    """Per output column: the factor the kernel's fp32 sum is multiplied by (see the ``.cu``)."""
    if fmt == "nvfp4":
        gs = [m[2].reshape(1).float().to(device) for m in members]
        return torch.cat([torch.full((n,), 2.0 ** 7, device=device) / g
                          for n, g in zip(n_sizes, gs, strict=True)]).contiguous()
    return torch.full((sum(n_sizes),), 2.0 ** (bias - 98), device=device)


class Fp4Gemv:
    """``y = x @ W^T`` for ``x [M, K]`` (bf16, ``M <= MAX_M``) and FP4 weights stacked along N.

    Args:
        fmt: "nvfp4" or "mxfp4".
        members: ``(weight_packed, weight_scale, weight_global_scale or None)`` per weight (at
            most 3, each but the last a multiple of 16 rows), all with the same K (a multiple of
            ``STEP_K``), contiguous, on one CUDA device; read in place by every call (never
            written), so they must stay alive and where they are.
        variant: ``(warps a CTA, steps a warp loads at once, pipelined 0 / 1, tiles of 16
            features a CTA computes at once: 1 / 2)`` (a 3-tuple means one tile);
            :func:`default_variant` if None.
        split_k: CTAs that split K for each group of tiles (1..16; the partial sums meet in a
            float32 workspace of this GEMM, so its launches must not overlap: one stream);
            :func:`default_split_k` if None. Launches with a LoRA do not split.
    """

    def __init__(self, fmt: str, members: Sequence[tuple[torch.Tensor, torch.Tensor,
                                                          torch.Tensor | None]],
                 variant: tuple[int, ...] | None = None, split_k: int | None = None) -> None:
        if fmt not in ("nvfp4", "mxfp4"):
            raise ValueError(f"Fp4Gemv: fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
        _check_members(fmt, members)
        if variant is not None:
            variant = _checked_variant(variant)
        packed = [m[0] for m in members]
        self.fmt = fmt
        self.n_sizes = [int(p.shape[0]) for p in packed]
        self.n, self.k = sum(self.n_sizes), int(packed[0].shape[1]) * 2
        self.device = packed[0].device
        # the stored tensors themselves (read in place, never written); bytes as the kernel reads
        self.weights = [p.view(torch.uint8) for p in packed]
        self.scales = [m[1].view(torch.uint8) for m in members]
        self.mx_bias = max(mx_bias(s) for s in self.scales) if fmt == "mxfp4" else 0
        # the kernel's own per-column factor (not a ``col_scale`` for the consumer to apply)
        self.column_factor = _column_factor(fmt, members, self.n_sizes, self.mx_bias, self.device)
        self._sms = _multiprocessors(self.device)
        self.variant = variant or default_variant(self.n, self.k, self._sms)
        self.split_k = default_split_k(self.n, self.k, self._sms) if split_k is None else split_k
        if type(self.split_k) is not int or not 1 <= self.split_k <= 16:
            raise ValueError(f"Fp4Gemv: split_k must be an int in 1..16 or None, got {split_k!r}")
        # the split's meeting place ([N, 8] float32 sums, a counter a group of tiles): zeros
        # between launches (the last CTA of a group leaves them so)
        groups = -(-self.n // (16 * self.variant[3]))
        self._split = ((torch.zeros(self.n * MAX_M, device=self.device),
                        torch.zeros(groups, dtype=torch.int32, device=self.device))
                       if self.split_k > 1 else None)
        ptrs = [p for w, s in zip(self.weights, self.scales, strict=True)
                for p in (w.data_ptr(), s.data_ptr())]
        ends = [sum(self.n_sizes[:1]), sum(self.n_sizes[:2])]  # members 2 and 3 start there
        self._functions: dict[tuple[int, ...], tuple] = {}
        self._weight_args = (*ptrs, *ptrs[-2:] * (3 - len(self.weights)), *ends,
                             self.column_factor.data_ptr())

    def nbytes(self) -> int:
        """Bytes this GEMM adds to the weights it reads in place (its column factors, and with a
        split of K its workspace and counters)."""
        extra = [self.column_factor, *(self._split or ())]
        return sum(t.numel() * t.element_size() for t in extra)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 pdl: bool = False, sms: int | None = None,
                 lora: tuple | None = None) -> torch.Tensor:
        """``x [M, K]`` (contiguous bf16) -> ``[M, N]`` bf16 (into ``out`` when given: rows of
        stride ``out.stride(0)``, contiguous columns); ``pdl``: launched so that it may start
        while the kernel before it runs (it loads its first weights, then waits); ``sms``: at
        most as many CTAs as fit on that many multiprocessors at once (each loops over tiles of
        16 features), so that a kernel launched after it finds room beside it; by default one
        CTA a group of tiles (``split_k`` CTAs with a split). ``lora``: ``(state, a_cat [R, K], b_full [N, R])`` (bf16, contiguous; see
        :class:`qerl.kernels.fp4_gemv_lora.GemvLora`): the output is ``x W^T + (x a_cat^T)
        b_full^T`` for a block-diagonal ``b_full`` (a member's rows zero outside its rank slice;
        the kernel reads each member's window only), ``sms`` must then be None (one CTA a tile
        group)."""
        m = int(x.shape[0])
        if (x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.k
                or not 0 < m <= MAX_M or x.device != self.device):
            raise ValueError(f"Fp4Gemv: x must be bf16 [1..{MAX_M}, {self.k}] on {self.device}, "
                             f"got {x.dtype} {list(x.shape)} on {x.device}")
        if not x.is_contiguous() or x.data_ptr() % 16:  # a fresh copy is both
            x = x.clone(memory_format=torch.contiguous_format)
        if out is None:
            out = torch.empty(m, self.n, device=x.device, dtype=torch.bfloat16)
        elif (out.dtype != torch.bfloat16 or tuple(out.shape) != (m, self.n)
              or out.device != self.device or (self.n > 1 and out.stride(1) != 1)):
            raise ValueError(f"Fp4Gemv: out must be bf16 [{m}, {self.n}] on {self.device} with "
                             f"contiguous columns, got {out.dtype} {list(out.shape)} stride "
                             f"{out.stride()}")
        if sms is not None and (sms < 1 or lora is not None):
            raise ValueError(f"Fp4Gemv: sms must be a positive number of multiprocessors or "
                             f"None (None with lora), got {sms}")
        window = 0 if lora is None else lora[0].check(self, *lora[1:])
        ks = self.split_k if lora is None else 1
        warps, unr, pipe, ft = _fitting(self.variant, m, window)
        key = (warps, unr, pipe, ft, _mrows(m), window, int(ks > 1))
        if key not in self._functions:  # the process-wide lookup once per instance and variant
            self._functions[key] = kernel_function(self.fmt == "mxfp4", *key[:5],
                                                   x.device.index or 0, warps * 32, window, key[6])
        fn, per_sm = self._functions[key]
        groups = -(-self.n // (16 * ft))  # what one CTA computes at once
        split = (self._split[0].data_ptr(), self._split[1].data_ptr(), ks) if ks > 1 else (0, 0, 1)
        if lora is None:
            items = groups * ks
            grid, extra = items if sms is None else min(items, sms * per_sm), _NO_LORA
        else:  # every CTA that waits has done its shrink items; the items it waits for are
            # taken by CTAs that start after it: resident at once if the items or the grid fit
            grid, extra = groups, lora[0].args(*lora[1:])
            if min(grid, lora[0].split) > per_sm * self._sms:
                raise ValueError(f"Fp4Gemv: {lora[0].split} LoRA shrink items and {grid} CTAs, "
                                 f"more than the {per_sm * self._sms} CTAs the GPU holds at once "
                                 "(the launch could wait forever): a lower rank or a shorter K")
        launch(fn, grid, warps * 32, x.device, pdl,
                (x.data_ptr(), *self._weight_args, out.data_ptr(), m, self.n, self.k,
                 out.stride(0), self.mx_bias, *extra, *split))
        return out


def _checked_variant(variant: Sequence[int]) -> tuple[int, int, int, int]:
    """``variant`` as ``(warps, steps, pipelined, tiles)`` (a 3-tuple means one tile), or a
    ValueError saying what it must be."""
    full = (*variant, 1) if len(variant) == 3 else tuple(variant)
    warps, unr, pipe, ft = (*full, 0, 0, 0, 0)[:4]
    if not (len(full) == 4 and all(type(v) is int for v in full)
            and 1 <= warps <= 16 and unr >= 1 and pipe in (0, 1) and ft in (1, 2)):
        raise ValueError(f"Fp4Gemv: variant must be ints (1..16 warps, >= 1 steps, pipelined "
                         f"0 or 1[, 1 or 2 tiles: 1 if left out]), got {variant}")
    return full


def _multiprocessors(device: torch.device) -> int:
    """The multiprocessors of ``device`` (132, an H100's or H200's, where it is not a GPU)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_members(fmt: str, members) -> None:
    """Every way the members could make the kernel read out of bounds, as a ValueError naming
    the tensor and what it must be (before any copy or launch)."""
    if not 1 <= len(members) <= 3:
        raise ValueError(f"Fp4Gemv: 1 to 3 weights side by side, got {len(members)}")
    spec = FORMATS[fmt]
    k = int(members[0][0].shape[1]) * 2
    if k % STEP_K:
        raise ValueError(f"Fp4Gemv: K = {k} is not a multiple of {STEP_K}")
    device = members[0][0].device
    for i, (packed, scale, gscale) in enumerate(members):
        if int(packed.shape[1]) * 2 != k:
            raise ValueError("Fp4Gemv: stacked weights must share K")
        if packed.element_size() != 1 or scale.element_size() != 1:
            raise ValueError(f"Fp4Gemv: weight {i}: weight_packed and weight_scale must be "
                             "1-byte tensors (codes, E4M3 / E8M0 scales)")
        if tuple(scale.shape) != (packed.shape[0], k // spec.block_size):
            raise ValueError(f"Fp4Gemv: weight {i}: weight_scale must be [{packed.shape[0]}, "
                             f"{k // spec.block_size}] (K / {spec.block_size}), got "
                             f"{list(scale.shape)}")
        if spec.has_global_scale and gscale is None:
            raise ValueError(f"Fp4Gemv: weight {i}: NVFP4 needs weight_global_scale")
        if packed.device != device or scale.device != device:
            raise ValueError(f"Fp4Gemv: weight {i} is not on {device}")
        if not (packed.is_contiguous() and scale.is_contiguous()):
            raise ValueError("Fp4Gemv: weight_packed and weight_scale must be contiguous")
        if packed.data_ptr() % 16 or scale.data_ptr() % 2:
            raise ValueError(f"Fp4Gemv: weight {i}: weight_packed must start 16-byte aligned "
                             "and weight_scale 2-byte aligned (a fresh tensor is)")
        if i < len(members) - 1 and packed.shape[0] % 16:
            raise ValueError("Fp4Gemv: each weight but the last must have a multiple of 16 "
                             f"rows; got {[int(m[0].shape[0]) for m in members]}")


_NO_LORA = (0, 0, 0, 0, 0, 0, 0, 0, 0)


def _mrows(m: int) -> int:
    """The activation rows a kernel variant is compiled for: 1, 2, 4 or 8 (at least ``m``)."""
    return 1 << max(0, (m - 1).bit_length())


def _smem_bytes(warps: int, unr: int, ft: int, mrows: int, lora: int = 0) -> int:
    """A variant's static shared memory (the ``.cu`` file's ``static_assert``): staged activations
    (``warps * steps * rows * 256`` bytes) and partial sums (``warps * tiles * 512``); with a LoRA
    window of ``lora`` ranks also its rows of ``b_full`` (``tiles * lora * 32``), LoRA terms
    (``tiles * rows * 64``), the shrink's rows (``rows * 12 * lora``) and the ticket (8)."""
    plain = warps * (unr * mrows * 256 + 512 * ft)
    return plain + (ft * (lora * 32 + 64 * mrows) + mrows * 12 * lora + 8 if lora else 0)


def _fitting(variant: tuple[int, int, int, int], m: int,
             lora: int = 0) -> tuple[int, int, int, int]:
    """``variant`` with fewer steps in flight where its shared memory (:func:`_smem_bytes`)
    would exceed 48 KiB; a ValueError where one step does not fit either."""
    warps, unr, pipe, ft = variant
    while unr > 1 and _smem_bytes(warps, unr, ft, _mrows(m), lora) > 48 * 1024:
        unr //= 2
    if _smem_bytes(warps, unr, ft, _mrows(m), lora) > 48 * 1024:
        raise ValueError(f"Fp4Gemv: variant {variant} at {m} rows (LoRA window {lora}) needs "
                         f"{_smem_bytes(warps, unr, ft, _mrows(m), lora)} bytes of shared memory, "
                         "more than 48 KiB: use fewer warps or one tile a CTA")
    return warps, unr, pipe, ft
