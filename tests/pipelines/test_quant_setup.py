"""The quant_setup pipeline's nodes on a tiny model: the policy + per-layer report, and the
five-format comparison (bits per weight follow from each format's block layout)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl.params import TrainParams
from qerl.pipelines.quant_setup.nodes import compare_formats, setup_policy


def _params(model_dir: Path, fmt: str = "nvfp4") -> tuple:
    p = TrainParams(model={"path": str(model_dir), "device": "cpu"}, quant={"format": fmt})
    return p.model, p.quant, p.lora


def test_setup_policy_reports_every_linear(tiny_model_dir: Path) -> None:
    policy, report = setup_policy(*_params(tiny_model_dir, "mxfp4"))
    linears = [n for n, m in policy.model.named_modules() if n.endswith("base_layer")]
    assert len(report[report["format"] == "mxfp4"]) == len(linears) > 0
    assert report.loc[report["format"] == "mxfp4", "rel_error"].between(0.01, 0.3).all()
    out = policy.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert out.shape[:2] == (1, 3) and torch.isfinite(out).all()


def test_compare_formats_bits_and_errors(tiny_model_dir: Path) -> None:
    table = compare_formats(*_params(tiny_model_dir)).set_index("format")
    assert list(table.index) == ["none", "nf4", "fp4", "nvfp4", "mxfp4"]
    assert table.loc["none", "quantized_layers"] == 0 and table.loc["none", "rel_error_max"] == 0
    n_linear = int(table.loc["nvfp4", "quantized_layers"])
    assert n_linear > 0 and (table.loc[["nf4", "fp4", "mxfp4"], "quantized_layers"] == n_linear).all()
    # E2M1 codes (4 bits) + one FP8 scale per 16 (+0.5) + a global scale; + one E8M0 per 32 (+0.25)
    assert table.loc["nvfp4", "bits_per_weight_quantized_layers"] == pytest.approx(4.5, abs=0.02)
    assert table.loc["mxfp4", "bits_per_weight_quantized_layers"] == pytest.approx(4.25, abs=1e-9)
    assert 4.0 < table.loc["nf4", "bits_per_weight_quantized_layers"] < 4.6
    assert (table.loc[["nf4", "fp4", "nvfp4", "mxfp4"], "rel_error_mean"] > 0).all()
    assert table.loc["nvfp4", "weight_bytes"] < table.loc["none", "weight_bytes"] / 3
