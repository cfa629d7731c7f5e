"""Training curves as matplotlib figures (written by the catalog as versioned PNGs)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

PANELS = (
    ("reward_mean", "reward (mean)"),
    ("entropy", "rollout entropy (nats/token)"),
    ("sigma", "AQN sigma"),
    ("kl_to_base", "KL(policy || base)"),
)


def training_figures(metrics: pd.DataFrame) -> dict[str, plt.Figure]:
    """One figure per curve (reward, entropy, sigma, KL) plus an overview grid."""
    figs: dict[str, plt.Figure] = {}
    overview, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax_all, (col, label) in zip(axes.flat, PANELS, strict=False):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for a in (ax, ax_all):
            if col in metrics and metrics[col].notna().any():
                a.plot(metrics["step"], metrics[col], marker=".", lw=1)
            else:
                a.text(0.5, 0.5, f"{col} not recorded", ha="center", va="center", transform=a.transAxes)
            a.set_xlabel("step")
            a.set_ylabel(label)
            a.grid(alpha=0.3)
        fig.tight_layout()
        figs[f"{col}.png"] = fig
    overview.tight_layout()
    figs["overview.png"] = overview
    return figs
