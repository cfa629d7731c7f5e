"""Stage 4, reward scoring: weighted reward functions per completion, then GRPO's group-normalised
advantages (one group = the G samples of one prompt) and DAPO's dynamic-sampling filter."""

from __future__ import annotations

import functools
import json
import time
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from qerl.rewards.base import build_rewards
from qerl.rewards.scoring import score_completions
from qerl.rl.objective import dynamic_sampling_mask, group_advantages
from qerl.train.metrics import group_size

if TYPE_CHECKING:
    from qerl.params import RewardParams, RLParams


@functools.lru_cache(maxsize=16)
def _cached_rewards(spec_json: str) -> list[Any]:
    return build_rewards(json.loads(spec_json), "qerl.rewards.functions")


def reward_functions(rewards: RewardParams) -> list[Any]:
    """The configured weighted reward functions (built once per configuration and process)."""
    return _cached_rewards(json.dumps(rewards.specs(), sort_keys=True))


def score_step(rollouts: pd.DataFrame, rewards: RewardParams, rl: RLParams) -> pd.DataFrame:
    """Add ``reward_<fn>``, ``reward``, ``advantage`` and ``kept`` columns to the rollouts table
    (groups of ``group_size(rollouts)`` consecutive rows; ``rl.scale_by_std``, ``rl.dynamic_sampling``)."""
    t0 = time.perf_counter()
    columns = {c: rollouts[c].tolist() for c in ("answer", "task", "metadata", "completion_tokens") if c in rollouts}
    if "metadata" in columns:  # a hand-made table may carry no metadata
        columns["metadata"] = [json.loads(m) if isinstance(m, str) and m else (m if isinstance(m, dict) else {})
                               for m in columns["metadata"]]
    total, per_fn, n_errors = score_completions(
        reward_functions(rewards), rollouts["prompt"].tolist(), rollouts["completion"].tolist(), columns,
        on_error=rewards.on_error,
    )
    out = rollouts.copy()
    for name, values in per_fn.items():
        out[f"reward_{name}"] = values
    out["reward"] = total
    values = torch.tensor(total, dtype=torch.float32)
    g = group_size(rollouts)
    out["advantage"] = group_advantages(values, g, scale_by_std=rl.scale_by_std).tolist()
    keep = dynamic_sampling_mask(values, g) if rl.dynamic_sampling else torch.ones(len(out), dtype=torch.bool)
    out["kept"] = keep.tolist()
    out["reward_errors"] = sum(n_errors.values())
    out["score_seconds"] = time.perf_counter() - t0
    return out
