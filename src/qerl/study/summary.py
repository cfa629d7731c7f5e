"""Aggregate study runs (variant x seed) into the comparison table and plots."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from qerl.train.metrics import REWARD_MEAN, ROLLOUT_ENTROPY

if TYPE_CHECKING:  # matplotlib is imported by the plotting functions: every kedro command imports this module
    import matplotlib.pyplot as plt


def first_step_reaching(metrics: pd.DataFrame, column: str, threshold: float, window: int = 5) -> float:
    """First step whose trailing ``window``-step mean of ``column`` reaches ``threshold`` (NaN if never)."""
    rolled = metrics.sort_values("step")[column].rolling(window, min_periods=1).mean()
    hit = metrics.sort_values("step")["step"][rolled >= threshold]
    return float(hit.iloc[0]) if len(hit) else math.nan


def _pass_k(ev: pd.DataFrame) -> str:
    return [c for c in ev.columns if c.startswith("pass@") and c not in ("pass@1_greedy", "pass@1_sampled")][0]


def per_run_rows(metrics: pd.DataFrame, evaluation: pd.DataFrame, threshold: float) -> pd.DataFrame:
    """One row per (variant, seed): threshold step, entropy early, final pass@1/pass@k, KL, time, memory."""
    rows = []
    for (variant, seed), m in metrics.groupby(["variant", "seed"], sort=False):
        m = m.sort_values("step")
        third = m[m["step"] <= max(1, m["step"].max() // 3)]
        ev = evaluation[(evaluation["variant"] == variant) & (evaluation["seed"] == seed)].set_index("stage")
        rows.append(
            {
                "variant": variant,
                "seed": seed,
                "steps_to_threshold": first_step_reaching(m, REWARD_MEAN, threshold),
                "entropy_first_third": float(third[ROLLOUT_ENTROPY].mean()),
                "reward_last5": float(m[REWARD_MEAN].tail(5).mean()),
                "pass@1_before": float(ev.loc["before", "pass@1_greedy"]),
                "pass@1_after": float(ev.loc["after", "pass@1_greedy"]),
                "pass@k_before": float(ev.loc["before", _pass_k(ev)]),
                "pass@k_after": float(ev.loc["after", _pass_k(ev)]),
                "kl_to_full_precision": float(ev.loc["after", "kl_base_to_fp"]) if "kl_base_to_fp" in ev else math.nan,
                "seconds_per_step": float(m["time/step"].mean()),
                "peak_mem_gib": float(m["memory/peak_gib"].max()),
            }
        )
    return pd.DataFrame(rows)


def summary_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Mean and std over seeds for every numeric column of :func:`per_run_rows`."""
    num = [c for c in runs.columns if c not in ("variant", "seed")]
    g = runs.groupby("variant", sort=False)[num]
    out = g.mean().add_suffix("_mean").join(g.std(ddof=1).add_suffix("_std"))
    out.insert(0, "seeds", runs.groupby("variant", sort=False)["seed"].count())
    ordered = ["seeds"] + [c for n in num for c in (f"{n}_mean", f"{n}_std")]
    return out[ordered].reset_index()


def curves_figure(metrics: pd.DataFrame, column: str, label: str) -> plt.Figure:
    """Mean over seeds (line) and min-max spread (band) of ``column`` per variant."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for variant, m in metrics.groupby("variant", sort=False):
        piv = m.pivot_table(index="step", columns="seed", values=column)
        ax.plot(piv.index, piv.mean(axis=1), label=variant, lw=1.4)
        ax.fill_between(piv.index, piv.min(axis=1), piv.max(axis=1), alpha=0.15)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def final_accuracy_figure(runs: pd.DataFrame) -> plt.Figure:
    """Held-out greedy pass@1 after training per variant: mean +- std over seeds, seeds as dots."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    variants = list(dict.fromkeys(runs["variant"]))
    for i, v in enumerate(variants):
        vals = runs.loc[runs["variant"] == v, "pass@1_after"].to_numpy()
        ax.bar(i, vals.mean(), yerr=vals.std(ddof=1) if len(vals) > 1 else 0, alpha=0.6, capsize=3)
        ax.scatter(np.full(len(vals), i), vals, color="k", s=8, zorder=3)
    ax.set_xticks(range(len(variants)), variants, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("held-out greedy pass@1 after RL")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig
