"""Every random draw of a run derives from ``rl.seed``: one function names them.

``derive_seed(seed, step, purpose)`` gives an independent 62-bit seed per (run seed, step, purpose),
so the LoRA initialisation, the prompt order, the rollout sampling, the AQN draws and the
minibatch order are each a pure function of the run's seed and the step. A resumed run (or a
single-node replay of step s) therefore draws exactly what an uninterrupted run drew there, and
no draw depends on the global RNG state.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

PURPOSES = ("lora_init", "prompts", "sampling", "aqn", "minibatch", "eval")


def derive_seed(seed: int, step: int, purpose: str, index: int | None = None) -> int:
    """A deterministic 62-bit seed for ``purpose`` at ``step`` of a run seeded with ``seed`` (and, when
    given, item ``index`` of the step, e.g. the step's prompt number: one stream per prompt)."""
    if purpose not in PURPOSES:
        raise ValueError(f"unknown seed purpose {purpose!r}; one of {PURPOSES}")
    parts = [int(seed) & 0xFFFFFFFF, int(step) & 0xFFFFFFFF, zlib.crc32(purpose.encode())]
    if index is not None:
        parts.append(int(index) & 0xFFFFFFFF)
    return int(np.random.SeedSequence(parts).generate_state(2, np.uint64)[0] >> 2)


def generator(seed: int, step: int, purpose: str, device: torch.device | str = "cpu",
              index: int | None = None) -> torch.Generator:
    """A torch generator on ``device`` seeded with :func:`derive_seed`."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, step, purpose, index))
