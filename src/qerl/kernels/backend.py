"""Which implementation runs the 4-bit (NVFP4 / MXFP4) matmuls on CUDA: the backend selection.

Backends (``FP4_BACKENDS``):

* ``humming``: humming-kernels (``pip install -e '.[gpu]'``) for decode-sized inputs
  (``M <= humming_max_m()`` rows), the Triton dequantize + cuBLAS path above that;
* ``triton``: our Triton kernel dequantizes the layer into a shared bf16 scratch buffer, then
  cuBLAS multiplies (any ``M``);
* ``torch``: the same with the dequantization in plain torch ops (the reference; what CPU tensors
  always use, whatever the backend).

Precedence: an explicit ``name`` passed to :func:`resolve_backend` > the process-wide choice of
:func:`use_backend` (what the ``quant.backend`` setting is wired to) > the ``QERL_FP4_BACKEND``
environment variable > ``auto``, which takes the first available of humming, triton, torch.
A backend is available when its package imports and CUDA is present (``torch`` always is).
"""

from __future__ import annotations

import functools
import importlib
import os

import torch

from qerl.errors import QerlConfigError

__all__ = [
    "FP4_BACKENDS",
    "available_backends",
    "backend_available",
    "humming_max_m",
    "resolve_backend",
    "use_backend",
]

FP4_BACKENDS: tuple[str, ...] = ("humming", "triton", "torch")
"""The 4-bit matmul backends, fastest first (the order ``auto`` tries them in)."""

ENV_VAR = "QERL_FP4_BACKEND"
MAX_M_ENV_VAR = "QERL_HUMMING_MAX_M"

# Rows up to which humming beats Triton dequantize + cuBLAS (benchmarks/fp4_matmul.py, H200,
# 7B layer shapes; docs/benchmarks.md). Above it every backend dequantizes into the scratch.
HUMMING_MAX_M = 512

_chosen: str = "auto"


@functools.cache
def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False
    return True


def backend_available(name: str) -> bool:
    """Whether backend ``name`` can run on this machine (``torch`` always can)."""
    if name == "torch":
        return True
    if name not in FP4_BACKENDS or not torch.cuda.is_available():
        return False
    return _importable("triton") and (name == "triton" or _importable("humming"))


def available_backends() -> list[str]:
    """The backends that can run here, fastest first."""
    return [b for b in FP4_BACKENDS if backend_available(b)]


def _check(name: str, field: str) -> str:
    if name == "auto":
        return name
    if name not in FP4_BACKENDS:
        raise QerlConfigError(field, f"unknown FP4 matmul backend {name!r}",
                              f"use auto or one of {', '.join(FP4_BACKENDS)}")
    if not backend_available(name):
        need = "humming-kernels (pip install -e '.[gpu]')" if name == "humming" else "triton"
        raise QerlConfigError(field, f"FP4 matmul backend {name!r} is not available here "
                              f"(needs CUDA and {need})",
                              f"use auto or one of {', '.join(available_backends())}")
    return name


def use_backend(name: str) -> str:
    """Set the process-wide backend (``auto`` or one of ``FP4_BACKENDS``); returns the previous
    setting. Raises ``QerlConfigError("quant.backend", ...)`` for an unknown or unavailable one,
    before anything changes. The integrator wires the ``quant.backend`` setting to this."""
    global _chosen
    _check(name, "quant.backend")
    previous, _chosen = _chosen, name
    return previous


def resolve_backend(name: str = "auto") -> str:
    """The backend that runs: ``name`` if not ``auto``, else the :func:`use_backend` choice, else
    ``$QERL_FP4_BACKEND``, else the fastest available (see the module docstring)."""
    if name != "auto":
        return _check(name, "quant.backend")
    if _chosen != "auto":
        return _chosen
    env = os.environ.get(ENV_VAR, "").strip().lower()
    if env and env != "auto":
        return _check(env, ENV_VAR)
    return available_backends()[0]


def humming_max_m() -> int:
    """Largest row count routed to humming (``$QERL_HUMMING_MAX_M`` overrides the default)."""
    raw = os.environ.get(MAX_M_ENV_VAR)
    if raw is None:
        return HUMMING_MAX_M
    if not raw.isdigit():
        raise QerlConfigError(MAX_M_ENV_VAR, f"must be a non-negative integer, got {raw!r}",
                              f"unset it (default {HUMMING_MAX_M}) or give e.g. 256")
    return int(raw)
