"""Training curves as matplotlib figures (saved by the catalog as versioned PNGs, or shown inline
in a notebook: no backend is forced here). Each curve is drawn raw (faint) and smoothed (an
exponential moving average); the held-out evaluation is a before/after bar; every figure carries
the run's name."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from qerl.train.metrics import REWARD_MEAN, ROLLOUT_ENTROPY, SIGMA

PANELS = (
    (REWARD_MEAN, "reward (mean over the batch)"),
    (ROLLOUT_ENTROPY, "rollout entropy (nats/token)"),
    (SIGMA, "AQN sigma"),
    ("train/kl_to_base", "KL(policy || base)"),
    ("mismatch/kl", "rollout/trainer mismatch KL"),
)


def smooth(values: pd.Series, alpha: float = 0.2) -> pd.Series:
    """Exponential moving average (the bold line over the raw curve)."""
    return values.ewm(alpha=alpha, ignore_na=True).mean()


def curve(ax: plt.Axes, metrics: pd.DataFrame, column: str, label: str) -> None:
    """Raw (faint) and smoothed ``column`` over steps on ``ax``."""
    if column in metrics and metrics[column].notna().any():
        ax.plot(metrics["step"], metrics[column], color="C0", alpha=0.25, lw=1)
        ax.plot(metrics["step"], smooth(metrics[column]), color="C0", lw=2)
    else:
        ax.text(0.5, 0.5, f"{column} not recorded", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)


def evaluation_bars(ax: plt.Axes, evaluation: pd.DataFrame) -> None:
    """Held-out greedy pass@1, sampled pass@1 and pass@k before and after training."""
    cols = [c for c in evaluation.columns if c.startswith("pass@")]
    ev = evaluation.set_index("stage")
    width = 0.38
    for j, stage in enumerate(s for s in ("before", "after") if s in ev.index):
        vals = [float(ev.loc[stage, c]) for c in cols]
        bars = ax.bar([i + (j - 0.5) * width for i in range(len(cols))], vals, width, label=stage)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(cols)), cols)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("held-out accuracy")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)


def training_figures(metrics: pd.DataFrame, evaluation: pd.DataFrame | None = None) -> dict[str, plt.Figure]:
    """One figure per curve, the evaluation bars, and an overview grid, each titled with the run."""
    title = str(metrics["run"].iloc[0]) if "run" in metrics and len(metrics) else "qerl run"
    figs: dict[str, plt.Figure] = {}
    overview, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax_all, (col, label) in zip(axes.flat, PANELS, strict=False):
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        for a in (ax, ax_all):
            curve(a, metrics, col, label)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        figs[f"{col.replace('/', '_')}.png"] = fig
    if evaluation is not None and len(evaluation):
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        for a in (ax, axes.flat[-1]):
            evaluation_bars(a, evaluation)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        figs["evaluation.png"] = fig
    overview.suptitle(title)
    overview.tight_layout()
    figs["overview.png"] = overview
    return figs
