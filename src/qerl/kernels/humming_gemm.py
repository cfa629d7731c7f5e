"""humming-kernels as the CUDA FP4 GEMM: ``y = x @ W^T`` with ``W`` one or several FP4 weights.

:class:`HummingFp4` prepares humming's tensors once from our compressed-tensors buffers (which it
never modifies: it works on copies) and then only launches kernels. Several weights that share
the input (q/k/v, gate/up) become one GEMM whose output columns are the members' outputs side by
side. NVFP4 members with different global scales are stacked with a global scale of 1, and the
per-column factor ``1 / weight_global_scale`` is returned as :attr:`HummingFp4.col_scale` for the
consumer of the output to apply (the rollout engine's epilogue kernels do; exact, since the
scale is applied to the float32 accumulator's rounding in the same way as a fused scale would be
up to one bf16 rounding); in the ``ct`` layout a single weight, MXFP4, or equal global scales
need no such factor (the ``bf16_scales`` layout always has one).

Layouts of humming's copy (``layout``; the compressed-tensors buffers on disk and in the model never
change): ``"ct"`` hands humming our tensors as they are (NVFP4: E4M3 group scales, the global
scale in the kernel); ``"bf16_scales"`` (NVFP4 only) gives it the same E2M1 codes with the E4M3
group scales widened to bf16 (exact: an E4M3 value has 4 significant bits) and every global scale
as ``col_scale``, so the kernel's dequantization is one bf16 multiply per weight pair instead of
an E4M3 conversion first. Same values, 2 instead of 1 scale bytes per 16 weights (+11 % bytes).

Kernel choice per row count ``M``: tuned configurations from :mod:`qerl.kernels.tuning` (humming's
tuner candidates, timed on this GPU and cached in a file) for the ``M`` they were tuned at and the
``M`` below down to the previous tuned one, humming's own heuristic choice elsewhere; one
configuration per ``M``, so only the kernels that run are compiled (each once per process, and
humming keeps the compiled kernels in its disk cache).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from qerl.quant.formats import FORMATS

__all__ = ["LAYOUTS", "HummingFp4", "config_string", "humming_weight_config", "layout_applies",
           "on_sms", "precompile"]

LAYOUTS = ("ct", "bf16_scales")


def layout_applies(layout: str, fmt: str, dtype: torch.dtype) -> bool:
    """Whether humming's ``layout`` exists for weights of ``fmt`` with ``dtype`` activations
    (``ct`` always; ``bf16_scales`` for NVFP4 with bf16 activations)."""
    return layout == "ct" or (fmt == "nvfp4" and dtype == torch.bfloat16)

PAD_N = 256  # humming's tiles need N and K in whole tiles; padding is free for the model shapes
PAD_K = 128


def config_string(cfg: dict) -> str:
    """A tuning config as the JSON string humming parses (enums by value, numpy scalars as
    Python numbers); the same config always gives the same string (humming caches by it)."""

    def plain(v):
        if hasattr(v, "value"):
            return v.value
        if hasattr(v, "item"):
            return v.item()
        raise TypeError(f"not JSON-serialisable in a humming config: {v!r}")

    return json.dumps(cfg, sort_keys=True, default=plain)


def on_sms(cfg: dict, sms: int | None) -> dict:
    """``cfg`` on at most ``sms`` multiprocessors (humming's ``num_sms``; a config that already
    asks for fewer keeps its smaller grid); ``cfg`` itself when ``sms`` is ``None``."""
    return {**cfg, "num_sms": min(int(cfg.get("num_sms") or sms), int(sms))} if sms else cfg


def humming_weight_config(fmt: str, layout: str = "ct") -> dict:
    """humming's ``weight_config`` for our stored layout (compressed-tensors schema), or for the
    ``bf16_scales`` layout (humming's own schema: E2M1 codes, bf16 group scales, no global)."""
    spec = FORMATS[fmt]
    if layout == "bf16_scales":
        return {"quant_method": "humming", "b_dtype": "float4e2m1", "bs_dtype": "bfloat16",
                "group_size": spec.block_size}
    return {"quant_method": "compressed-tensors", "format": spec.ct_format, "type": "float",
            "num_bits": 4, "strategy": spec.ct_strategy, "group_size": spec.block_size}


class HummingFp4:
    """One humming GEMM over FP4 weights stacked along N (see the module docstring).

    Args:
        fmt: "nvfp4" or "mxfp4".
        members: ``(weight_packed, weight_scale, weight_global_scale or None)`` per weight, all
            with the same K, on one CUDA device.
        bias: optional ``[sum N]`` bias added by the kernel (only for ``col_scale is None``).
        dtype: activation / output dtype (bf16 or fp16).
        layout: humming's copy, ``"ct"`` or ``"bf16_scales"`` (see the module docstring).
    """

    def __init__(self, fmt: str, members: Sequence[tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor | None]],
                 bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
                 layout: str = "ct") -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"HummingFp4: layout must be one of {LAYOUTS}, got {layout!r}")
        if not layout_applies(layout, fmt, dtype):
            raise ValueError(f"HummingFp4: layout {layout!r} is for nvfp4 only, with bf16 "
                             f"activations; got {fmt!r} with {dtype}")
        packed = [m[0] for m in members]
        self.fmt, self.dtype, self.layout = fmt, dtype, layout
        self.kind = fmt if layout == "ct" else f"{fmt}_{layout}"  # the tuning cache's key
        self.device = packed[0].device
        self.n_sizes = [int(p.shape[0]) for p in packed]
        self.n, self.k = sum(self.n_sizes), int(packed[0].shape[1]) * 2
        if any(int(p.shape[1]) * 2 != self.k for p in packed):
            raise ValueError("HummingFp4: stacked weights must share K")
        tensors = {"weight_packed": torch.cat(packed).contiguous() if len(packed) > 1
                   else packed[0].clone(),
                   "weight_scale": torch.cat([m[1] for m in members]).contiguous()}
        self.col_scale: torch.Tensor | None = None
        if layout == "bf16_scales":
            self.col_scale = self._col_scale(members)
            scale = tensors["weight_scale"]
            tensors = {"weight": tensors["weight_packed"].view(torch.int32),
                       "weight_scale": (scale if scale.dtype == torch.float8_e4m3fn
                                        else scale.view(torch.float8_e4m3fn)).to(dtype)}
        elif FORMATS[fmt].has_global_scale:
            gs = torch.cat([m[2].reshape(1).float() for m in members])
            if len(members) > 1 and bool((gs != gs[0]).any()):
                self.col_scale = self._col_scale(members)
                gs = torch.ones(1, device=self.device)
            tensors["weight_global_scale"] = gs[:1].clone()
        if bias is not None:
            if self.col_scale is not None:
                raise ValueError("HummingFp4: a bias with per-column scales must be added by the "
                                 "consumer of the output")
            tensors["bias"] = bias.detach().to(dtype).contiguous()
        self.layer = _build_layer(tensors, self.n, self.k, humming_weight_config(fmt, layout),
                                  bias is not None, dtype, self.device)
        self._tuned: dict[int | None, dict[int, dict]] = {}  # per ``sms``: the tuned configs
        self._tuning: dict[int, str] = {}

    def _col_scale(self, members) -> torch.Tensor:
        """``1 / weight_global_scale`` of each member, repeated over its output columns."""
        return torch.cat([torch.full((n,), 1.0, device=self.device) / m[2].reshape(1).float()
                          for n, m in zip(self.n_sizes, members, strict=True)])

    # -- kernel choice ------------------------------------------------------------------------

    def layer_config(self):
        """humming's ``LayerConfig`` of this GEMM."""
        return self.layer.humming_config

    def tuning_for(self, m: int, pdl: bool = False, sms: int | None = None) -> str:
        """The tuning config (a JSON string humming caches kernels by) for ``m`` rows: the tuned
        one whose interval ``(previous tuned M, tuned M]`` holds ``m``, else humming's heuristic
        choice for ``m``; with ``use_pdl`` set to ``pdl`` (programmatic dependent launch: the
        kernel may start while the one before it runs, and waits for it before its first load);
        ``sms``: at most that many multiprocessors (humming's ``num_sms``, a launch parameter:
        the same compiled kernel on a smaller persistent grid; the configs tuned for that many,
        where the tuning files have them). One config per ``(m, pdl, sms)``, so only kernels
        that run get compiled."""
        hit = self._tuning.get((m, pdl, sms))
        if hit is None:
            if sms not in self._tuned:
                from qerl.kernels import tuning

                self._tuned[sms] = tuning.lookup(self.kind, self.n, self.k, self.dtype,
                                                 self.device, sms=sms)
            table = self._tuned[sms]
            tuned = [t for t in sorted(table) if t >= m]
            if tuned:
                cfg = table[tuned[0]]
            else:
                from humming.tune import get_heuristics_config

                cfg = get_heuristics_config(self.layer_config(), shape_m=m, device=self.device)
            hit = self._tuning[m, pdl, sms] = config_string(on_sms({**cfg, "use_pdl": bool(pdl)}, sms))
        return hit

    # -- running ------------------------------------------------------------------------------

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None,
                 tuning: str | None = None, pdl: bool = False,
                 sms: int | None = None) -> torch.Tensor:
        """``x [M, K]`` (contiguous, ``self.dtype``) -> ``[M, N]``; ``col_scale`` not applied;
        ``pdl`` / ``sms``: see :meth:`tuning_for`."""
        return self.layer(x, outputs=out,
                          tuning_config=tuning or self.tuning_for(x.shape[0], pdl, sms))

    def nbytes(self) -> int:
        """Bytes of humming's prepared tensors (what this GEMM keeps resident)."""
        return sum(p.numel() * p.element_size() for p in self.layer.parameters())


def _build_layer(tensors: dict[str, torch.Tensor], n: int, k: int, weight_config: dict,
                 has_bias: bool, dtype: torch.dtype, device: torch.device):
    """A transformed ``HummingLayer`` holding humming's copy of ``tensors`` (ours untouched).

    The layer is made on the meta device and given our tensors as its parameters (no extra
    allocation before ``transform``); if that fails, the documented way: allocate on the device,
    ``load_from_tensors`` (a copy), ``transform``."""
    from humming.layer import HummingLayer

    kw = dict(shape_n=n, shape_k=k, weight_config=weight_config,
              pad_n_to_multiple=PAD_N, pad_k_to_multiple=PAD_K, has_bias=has_bias,
              torch_dtype=dtype)
    try:
        with torch.cuda.device(device), torch.device("meta"):
            layer = HummingLayer(**kw)
        layer.locks = torch.zeros_like(layer.locks, device=device)
        for name, t in tensors.items():
            setattr(layer, name, torch.nn.Parameter(t, requires_grad=False))
        layer.transform()
        return layer
    except Exception:  # noqa: BLE001 - fall back to humming's documented loading path
        with torch.cuda.device(device), torch.device(device):
            layer = HummingLayer(**kw)
        layer.load_from_tensors(tensors)
        layer.transform()
        return layer


def precompile(jobs: Sequence[tuple[HummingFp4, int, bool, int | None]], workers: int = 16) -> None:
    """Compile the kernels that ``(gemm, rows, pdl, sms)`` calls will launch (see
    :meth:`HummingFp4.tuning_for`), in parallel threads (humming compiles with NVRTC / nvcc,
    outside the GIL); kernels already compiled are skipped."""
    from concurrent.futures import ThreadPoolExecutor

    from humming.kernel.humming import HummingKernel

    todo = {(g.layer_config().to_str(), g.tuning_for(m, p, s), g.device.index or 0): None
            for g, m, p, s in jobs if m > 0}

    def compile_one(key):
        layer, tuning, dev = key
        HummingKernel.prepare_kernels(layer, None, tuning, device=dev)

    if todo:
        with ThreadPoolExecutor(max_workers=max(1, min(workers, len(todo)))) as pool:
            list(pool.map(compile_one, todo))
