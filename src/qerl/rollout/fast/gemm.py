"""The base projections of one plan group on CUDA: raw outputs (no bias, no LoRA; with per-column
scales still to apply when :attr:`GroupGemm.col_scale` is set).

* all members FP4 of one format, ``gemv_max_m`` set and at most that many rows (decode at a
  small batch; backend ``humming``, bf16, Hopper or later; a shape where it beats humming,
  :func:`qerl.kernels.fp4_gemv.preferred`, or any with ``gemv_long_k``): our FP4 GEMV
  (:mod:`qerl.kernels.fp4_gemv`), which reads the members' stored tensors in place, the output
  finished (no column scales);
* all members FP4 of one format, backend ``humming``, at most ``humming_max_m()`` rows (any
  number with ``humming_only``): one humming GEMM for the whole group (q/k/v or gate/up stacked
  along N), prepared once per plan, in humming's ``layout`` of the weights (NVFP4 in bf16 only:
  ``"bf16_scales"`` widens the group scales to bf16, see :mod:`qerl.kernels.humming_gemm`);
* all members FP4 otherwise: the Triton (or torch) dequantize of every member into the shared
  scratch, then one cuBLAS GEMM;
* anything else member by member (dense ``F.linear``, FP4 through the scratch, other modules
  called as is, which add their own bias).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from qerl.kernels import dequant
from qerl.kernels.backend import humming_max_m
from qerl.rollout.fast.lora import lora_torch
from qerl.rollout.fast.plan import Group, Member

__all__ = ["GroupGemm", "precompile_groups"]


class GroupGemm:
    """Runs ``x @ W_i^T`` for every member ``i`` of ``group`` (see the module docstring)."""

    def __init__(self, group: Group, backend: str, dtype: torch.dtype,
                 humming_only: bool = False, layout: str = "ct", gemv_max_m: int = 0,
                 gemv_long_k: bool = False) -> None:
        self.group = group
        self.backend = backend
        self.dtype = dtype
        self.humming_only = humming_only  # every row count through humming (the source may be parked)
        self.humming = None
        # the LoRA inside the GEMV's launch: its state once made, False once it failed
        self.gemv, self.gemv_max_m, self._gemv_lora = None, gemv_max_m, None
        if gemv_max_m and backend == "humming" and group.all_fp4 and not humming_only:
            from qerl.kernels import fp4_gemv

            m0 = group.members[0]
            if (fp4_gemv.supports(m0.fmt, m0.in_f, gemv_max_m, dtype, m0.fp4_tensors()[0].device)
                    and fp4_gemv.preferred(group.out_f, group.in_f, gemv_long_k)):
                try:  # built and run once here: a layout it cannot read, or no NVRTC, is
                    # found before any graph capture, and humming runs the group instead
                    self.gemv = fp4_gemv.Fp4Gemv(m0.fmt, [m.fp4_tensors() for m in group.members])
                    self.gemv(torch.zeros(1, group.in_f, device=self.gemv.device, dtype=dtype))
                except Exception as e:  # noqa: BLE001 - degrade to humming, loudly
                    self.gemv = None
                    warnings.warn(f"fp4_gemv skips {m0.name} ({type(e).__name__}: {e}); "
                                  "humming runs it", stacklevel=2)
        if backend == "humming" and group.all_fp4 and dtype in (torch.bfloat16, torch.float16):
            from qerl.kernels import humming_gemm

            fmt = group.members[0].fmt
            if not humming_gemm.layout_applies(layout, fmt, dtype):
                layout = "ct"  # the stored layout where the asked-for one does not exist
            try:
                self.humming = humming_gemm.HummingFp4(
                    fmt, [m.fp4_tensors() for m in group.members], dtype=dtype, layout=layout)
            except Exception as e:  # noqa: BLE001 - degrade to the dequantize path, loudly
                warnings.warn(f"humming could not prepare {group.members[0].name} "
                              f"({type(e).__name__}: {e}); it runs through the Triton dequantize "
                              "+ cuBLAS path", stacklevel=2)

    @property
    def col_scale(self) -> torch.Tensor | None:
        """Per-column factors the consumer must apply to humming's output (else ``None``)."""
        return None if self.humming is None else self.humming.col_scale

    def uses_gemv(self, rows: int) -> bool:
        return self.gemv is not None and 0 < rows <= self.gemv_max_m

    def lora_in_gemv(self, rows: int) -> bool:
        """Whether the group's LoRA can run inside its GEMV launch at ``rows``
        (:mod:`qerl.kernels.fp4_gemv_lora`: the GEMV runs them, no rank above 128)."""
        if not (self.group.r_total and self.uses_gemv(rows) and self._gemv_lora is not False):
            return False
        from qerl.kernels.fp4_gemv_lora import lora_fits

        return lora_fits([m.lora_r for m in self.group.members])

    def uses_humming(self, rows: int) -> bool:
        return (self.humming is not None and 0 < rows and not self.uses_gemv(rows)
                and (self.humming_only or rows <= humming_max_m()))

    def beside_sms(self, rows: int, sms: int | None) -> int | None:
        """The multiprocessors this group's GEMM runs on beside its fused LoRA in decode at
        ``rows``: ``sms`` when the group has adapters and the GEMM is humming's or our GEMV (the
        kinds that let the LoRA start beside them; the GEMV launches at most as many CTAs as fit
        on that many multiprocessors), else ``None`` (the whole GPU, the LoRA first)."""
        ok = self.uses_humming(rows) or self.uses_gemv(rows)
        return sms if sms is not None and self.group.r_total and ok else None

    def _impl(self) -> str:
        return "triton" if dequant.HAS_TRITON and self.backend != "torch" else "torch"

    def _dequantized(self, members: list[Member], device: torch.device) -> torch.Tensor:
        """All ``members`` dequantized into consecutive rows of the shared scratch."""
        w = dequant.scratch(device, self.dtype, sum(m.out_f for m in members), members[0].in_f)
        row = 0
        for m in members:
            dequant.dequantize_into(w[row:row + m.out_f], m.fmt, *m.fp4_tensors(),
                                    impl=self._impl())
            row += m.out_f
        return w

    def raw(self, x: torch.Tensor, pdl: bool = False, sms: int | None = None,
            lora: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[torch.Tensor]:
        """``x [M, K]`` -> the members' raw outputs ``[M, N_i]`` (views of one buffer when the
        group runs as one GEMM); ``pdl`` / ``sms``: humming's GEMM with programmatic dependent
        launch / on at most ``sms`` multiprocessors (:meth:`HummingFp4.tuning_for`); ``lora``:
        ``(a_cat, b_full)``, added inside the GEMV launch (only where :meth:`lora_in_gemv`)."""
        g, rows, y = self.group, x.shape[0], None
        if lora is not None:
            if not self.lora_in_gemv(rows):
                raise ValueError(f"GroupGemm: the LoRA of {g.members[0].name} cannot run inside "
                                 f"its GEMV at {rows} rows")
            try:
                if self._gemv_lora is None:  # the launches' counters and buffers, once
                    from qerl.kernels.fp4_gemv_lora import GemvLora

                    self._gemv_lora = GemvLora(self.gemv, [m.lora_r for m in g.members])
                y = self.gemv(x, pdl=pdl, lora=(self._gemv_lora, *lora))
            except (RuntimeError, ValueError) as e:  # its variant does not compile, or too many
                # CTAs: this call adds the LoRA in torch, later ones run it apart (lora_in_gemv)
                warnings.warn(f"the LoRA of {g.members[0].name} cannot run inside its GEMV "
                              f"({type(e).__name__}: {e}); it runs as its own launch",
                              stacklevel=2)
                self._gemv_lora = False
                y = self.gemv(x, pdl=pdl).add_(lora_torch(x, *lora))
        elif self.uses_gemv(rows):
            y = self.gemv(x, pdl=pdl, sms=sms)
        elif self.uses_humming(rows):
            y = self.humming(x if x.is_contiguous() else x.contiguous(), pdl=pdl, sms=sms)
        elif g.all_fp4:
            y = F.linear(x, self._dequantized(g.members, x.device))
        if y is not None:  # one GEMM for the group: its members' columns
            return [y[:, o:o + m.out_f] for o, m in zip(g.offsets, g.members, strict=True)]
        outs = []
        for m in g.members:
            if m.kind == "dense":
                outs.append(F.linear(x, m.weight))
            elif m.kind == "fp4":
                outs.append(F.linear(x, self._dequantized([m], x.device)))
            else:
                outs.append(m.module(x).to(x.dtype))
        return outs

    def max_scratch(self) -> int:
        """Scratch elements this group's dequantize path needs."""
        g = self.group
        if self.humming_only and self.humming is not None:
            return 0
        if g.all_fp4:
            return g.out_f * g.in_f
        return max((m.out_f * m.in_f for m in g.members if m.kind == "fp4"), default=0)


def precompile_groups(gemms: dict[int, GroupGemm], rows: tuple[int, ...],
                      decode_pdl: bool = False, decode_sms: int | None = None) -> None:
    """Compile the humming kernels the groups will launch (in parallel): prefill's and decode's,
    at ``rows = (decode rows, prefill rows)``; decode's with PDL when ``decode_pdl``, and for the
    groups with LoRA on at most ``decode_sms`` multiprocessors (the GEMM beside the fused LoRA,
    :mod:`qerl.rollout.fast.decode`: its own tuned configs)."""
    jobs = [(gm.humming, m, p, s) for gm in gemms.values()
            for m, p, s in {(rows[0], decode_pdl, gm.beside_sms(rows[0], decode_sms)),
                            *((r, False, None) for r in rows[1:])}
            if gm.uses_humming(m)]
    if jobs:
        from qerl.kernels.humming_gemm import precompile

        precompile(jobs)
