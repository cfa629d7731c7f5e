"""Shared pieces of the embedded-task tests: the preset file and a model small enough to train in
seconds on a CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from qerl.modeling.tiny import TinyModelSpec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def presets() -> dict:
    """The shipped task family (conf/base/parameters_embedded_tasks.yml)."""
    text = (ROOT / "conf" / "base" / "parameters_embedded_tasks.yml").read_text()
    return yaml.safe_load(text)["embedded_tasks"]


@pytest.fixture
def small_spec() -> TinyModelSpec:
    """One layer, hidden 64: the model the warm-start tests train."""
    return TinyModelSpec(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=1)
