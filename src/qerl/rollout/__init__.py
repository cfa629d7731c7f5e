"""Rollout engines behind one interface (:class:`~qerl.rollout.base.RolloutEngine`)."""

from __future__ import annotations

import functools

import torch

from qerl.errors import QerlConfigError
from qerl.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from qerl.rollout.hf import HFGenerateEngine

ENGINES = ("auto", "hf", "fast")


@functools.lru_cache(maxsize=8)
def get_engine(name: str, device: torch.device, kv_budget_gib: float | None = None,
               single_copy: bool = False) -> RolloutEngine:
    """``hf``: transformers generate; ``fast``: our static-cache engine (CUDA graphs on GPU, plain
    torch on CPU); ``auto``: fast on CUDA, hf on CPU. ``kv_budget_gib`` (``rollout.kv_budget_gib``):
    the fast engine runs the batch in waves whose KV cache fits it. ``single_copy``
    (``rollout.single_weight_copy``): the fast engine holds the 4-bit weights once on the GPU
    (``qerl.rollout.fast.residency``).

    One engine per (name, device, budget, single_copy) for the process: the fast engine keeps its plan and the
    prepared 4-bit GEMM tensors across RL steps; its KV cache and captured graph are released when
    each ``generate`` returns, so the update gets that memory back (``FastEngine(keep_state=True)``
    keeps them, for repeated calls without an update in between).
    """
    if name not in ENGINES:
        raise QerlConfigError("rollout.engine", f"unknown engine {name!r}", f"use one of {', '.join(ENGINES)}")
    if name == "hf" or (name == "auto" and device.type != "cuda"):
        return HFGenerateEngine()
    from qerl.rollout.fast import FastEngine

    return FastEngine(kv_budget_gib=kv_budget_gib, single_copy=single_copy)


__all__ = ["ENGINES", "HFGenerateEngine", "RolloutBatch", "RolloutEngine", "SamplingParams", "get_engine"]
