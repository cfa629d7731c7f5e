"""The per-step metrics row, built in one place, with prefixed names.

``rollout/*`` describe the sampling policy (the 4-bit base, live adapter and AQN noise) on the
step's completions; ``reward/*`` the scores; ``train/*`` the trainer's update on the clean policy;
``mismatch/*`` the rollout/trainer gap (:func:`qerl.rl.objective.rollout_is_weights`);
``noise/*``, ``time/*``, ``memory/*`` the rest. The noise controller and the plots read
``rollout/entropy``; the trainer's own token entropy is ``train/entropy``.

Under ``torchrun`` the row is the whole step's on every rank: the rollout and reward metrics are
computed over every rank's rows (:func:`global_view`), times and memory are the slowest rank's.
"""

from __future__ import annotations

import resource
from typing import Any

import numpy as np
import pandas as pd
import torch

from qerl.train import distributed as dist

ROLLOUT_ENTROPY = "rollout/entropy"
REWARD_MEAN = "reward/mean"
SIGMA = "noise/sigma"

#: Columns the console line shows, in order, with their formats.
CONSOLE = (
    (REWARD_MEAN, "reward {:.3f}"), (ROLLOUT_ENTROPY, "entropy {:.3f}"), (SIGMA, "sigma {:.1e}"),
    ("rollout/tokens_per_s", "tok/s {:.0f}"), ("train/loss", "loss {:+.4f}"), ("mismatch/kl", "mismatch kl {:.1e}"),
    ("mismatch/is_weight_mean", "is w {:.3f}"), ("time/generate", "gen {:.1f}s"), ("time/update", "update {:.1f}s"),
    ("memory/peak_gib", "peak {:.1f} GiB"),
)


#: Per-step columns of a step table and how the ranks' values combine (every other column the
#: metrics read is per row).
STEP_COLUMNS = {"step": "max", "sigma": "max", "noise_changed_fraction": "max", "generate_seconds": "max",
                "score_seconds": "max", "prompts_truncated": "sum", "prompts_dropped": "sum", "reward_errors": "sum"}
ROW_COLUMNS = ("sample", "completion_tokens", "truncated", "mean_entropy", "reward", "kept")


def global_view(scored: pd.DataFrame) -> pd.DataFrame:
    """The step table as the metrics read it, over every rank: the per-row columns of all ranks (rank
    order, numeric) and the per-step columns combined (:data:`STEP_COLUMNS`). ``scored`` itself
    without ``torchrun``."""
    if dist.world_size() == 1:
        return scored
    rows = [c for c in scored.columns if c in ROW_COLUMNS or (c.startswith("reward_") and c not in STEP_COLUMNS)]
    out = dist.gather_frames(scored[rows]).apply(pd.to_numeric, errors="coerce")
    first = {c: float(scored[c].iloc[0]) for c in STEP_COLUMNS if c in scored}
    return out.assign(**dist.all_sum({c: v for c, v in first.items() if STEP_COLUMNS[c] == "sum"}),
                      **dist.all_max({c: v for c, v in first.items() if STEP_COLUMNS[c] == "max"}))


def group_size(scored: pd.DataFrame) -> int:
    """Samples per prompt, from the sample index (a step may draw the same prompt twice)."""
    if "sample" in scored and len(scored):
        return int(scored["sample"].max()) + 1
    counts = scored.groupby("prompt_id", sort=False).size()
    return int(counts.iloc[0]) if len(counts) else 1


def rollout_metrics(rollouts: pd.DataFrame) -> dict[str, Any]:
    """``rollout/*``, ``noise/*`` and ``time/generate`` of a rollouts table."""
    gen_s = float(rollouts["generate_seconds"].iloc[0])
    n_tok = int(rollouts["completion_tokens"].sum())
    ent = rollouts["mean_entropy"]
    return {
        "step": int(rollouts["step"].iloc[0]),
        SIGMA: float(rollouts["sigma"].iloc[0]),
        "noise/changed_fraction": float(rollouts.get("noise_changed_fraction", pd.Series([0.0])).iloc[0]),
        ROLLOUT_ENTROPY: float(np.nanmean(ent)) if ent.notna().any() else float("nan"),
        "rollout/completion_len_mean": float(rollouts["completion_tokens"].mean()),
        "rollout/completion_len_max": int(rollouts["completion_tokens"].max()),
        "rollout/truncated_ratio": float(rollouts["truncated"].mean()),
        "rollout/tokens": n_tok,
        "rollout/tokens_per_s": n_tok / gen_s if gen_s > 0 else float("nan"),
        "rollout/prompts_truncated": int(rollouts["prompts_truncated"].iloc[0]),
        "rollout/prompts_dropped": int(rollouts["prompts_dropped"].iloc[0]),
        "time/generate": gen_s,
    }


def reward_metrics(scored: pd.DataFrame) -> dict[str, Any]:
    """``reward/*`` and ``time/score`` of a scored rollouts table."""
    g = group_size(scored)
    rewards = torch.tensor(scored["reward"].to_numpy(), dtype=torch.float32)
    groups = rewards.view(-1, g) if len(rewards) % g == 0 else rewards.view(1, -1)
    m: dict[str, Any] = {
        REWARD_MEAN: float(rewards.mean()),
        "reward/std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "reward/zero_std_group_frac": float((groups.std(dim=1) == 0).float().mean()) if groups.shape[1] > 1 else 1.0,
        "reward/errors": int(scored["reward_errors"].iloc[0]),
        "reward/groups_kept": int(scored["kept"].sum()) // max(1, g),
        "time/score": float(scored["score_seconds"].iloc[0]),
    }
    for col in scored.columns:
        if col.startswith("reward_") and col != "reward_errors":
            vals = pd.to_numeric(scored[col], errors="coerce")
            m[f"reward/{col[len('reward_'):]}"] = float(vals.mean()) if vals.notna().any() else float("nan")
    return m


def step_row(scored: pd.DataFrame, update: dict[str, float], update_seconds: float, device: torch.device) -> dict[str, Any]:
    """The step's whole metrics row: rollout, reward, update (``train/*``, ``mismatch/*``), time, memory
    (under ``torchrun`` the same row on every rank, see the module docstring)."""
    whole = global_view(scored)
    row = {**rollout_metrics(whole), **reward_metrics(whole)}
    row.update(update)
    row.update(dist.all_max({"time/update": update_seconds, "memory/peak_gib": peak_memory_gib(device),
                             "memory/alloc_retries": float(alloc_retries(device))}))
    row["time/step"] = row["time/generate"] + row["time/score"] + row["time/update"]
    return row


def mean_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    """Per-key mean over minibatch statistics (keys present in any)."""
    keys = {k for s in stats for k in s}
    return {k: float(np.mean([s[k] for s in stats if k in s])) for k in sorted(keys)}


def console_line(row: dict[str, Any], total: int, eta_s: float | None = None) -> str:
    """One line per step: step/total, the CONSOLE columns, and the ETA."""
    parts = [f"step {row['step']:>4}/{total}"]
    parts += [fmt.format(row[k]) for k, fmt in CONSOLE if k in row and row[k] == row[k]]
    if eta_s is not None:
        parts.append(f"eta {_duration(eta_s)}")
    return " | ".join(parts)


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory (CUDA) or peak resident set size (CPU), GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def alloc_retries(device: torch.device) -> int:
    """Times the CUDA caching allocator found no free block, released its cache and retried since
    the process started (0 off CUDA). Growth from step to step means the memory is nearly full and
    the update pays for synchronising frees: lower ``rl.micro_batch_tokens`` (or
    ``rl.memory_budget_gib``)."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _duration(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
