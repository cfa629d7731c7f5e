"""Quantized model setup on its own: build the policy in the configured format, and compare all
five formats on the same base (weight bytes, bits per weight, reconstruction error)."""

from __future__ import annotations

import gc
import logging

import pandas as pd

from qerl.params import LoraParams, ModelParams, QuantParams
from qerl.quant.formats import QUANT_FORMATS
from qerl.train.policy import Policy, build_policy

log = logging.getLogger(__name__)


def setup_policy(model: ModelParams, quant: QuantParams, lora: LoraParams) -> tuple[Policy, pd.DataFrame]:
    """The quantized LoRA policy and its per-layer quantization report."""
    policy, report = build_policy(model, quant, lora)
    return policy, pd.DataFrame(report)


def compare_formats(model: ModelParams, quant: QuantParams, lora: LoraParams) -> pd.DataFrame:
    """Total weight bytes, bits per weight and error of every format on the configured model."""
    rows = []
    for fmt in QUANT_FORMATS:
        policy, report = build_policy(model, quant.model_copy(update={"format": fmt}), lora)
        df = pd.DataFrame(report)
        quantized = df[df["format"] == fmt]
        total_bytes = int(df["weight_bytes"].sum())
        rows.append({
            "format": fmt,
            "linear_layers": len(df),
            "quantized_layers": len(quantized) if fmt != "none" else 0,
            "weight_bytes": total_bytes,
            "bits_per_weight": 8 * total_bytes / max(1, int(df["n_params"].sum())),
            "bits_per_weight_quantized_layers": (
                8 * int(quantized["weight_bytes"].sum()) / max(1, int(quantized["n_params"].sum()))
                if len(quantized) else float("nan")),
            "rel_error_mean": float(df["rel_error"].mean()),
            "rel_error_max": float(df["rel_error"].max()),
            "lora_params": sum(p.numel() for p in policy.lora_parameters()),
        })
        del policy
        gc.collect()
    table = pd.DataFrame(rows)
    log.info("format comparison:\n%s", table.to_string(index=False))
    return table
