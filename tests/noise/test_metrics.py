"""Noise metrics: KL(full || quant) and entropies against float64 references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from qerl.errors import QerlConfigError
from qerl.noise.metrics import entropy, kl_full_vs_quant, noise_report_row


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, 17, generator=g) * 2
    quant = full + 0.5 * torch.randn(3, 5, 17, generator=g)
    mask = torch.ones(3, 5, dtype=torch.bool)
    mask[1, 3:] = False
    mask[2, 1:] = False
    return full, quant, mask


def reference_kl(full, quant, mask):
    p = torch.softmax(full.double(), -1)
    per_pos = (p * (torch.log_softmax(full.double(), -1) - torch.log_softmax(quant.double(), -1)))
    return (per_pos.sum(-1)[mask]).mean().item()


def test_kl_self_is_zero_and_nonnegative(logits):
    full, quant, mask = logits
    assert kl_full_vs_quant(full, full, mask) == 0.0
    assert kl_full_vs_quant(full, quant, mask) > 0
    assert kl_full_vs_quant(quant, full) > 0


def test_kl_matches_float64_reference_and_torch_kl_div(logits):
    full, quant, mask = logits
    value = kl_full_vs_quant(full, quant, mask, chunk_size=4)
    assert value == pytest.approx(reference_kl(full, quant, mask), rel=1e-5)
    # torch.kl_div(input=log q, target=log p) is KL(p || q), summed then divided by positions
    torch_value = F.kl_div(torch.log_softmax(quant[mask].double(), -1),
                           torch.log_softmax(full[mask].double(), -1),
                           log_target=True, reduction="sum") / mask.sum()
    assert value == pytest.approx(torch_value.item(), rel=1e-5)
    # the direction matters: KL is not symmetric
    assert kl_full_vs_quant(quant, full, mask) != pytest.approx(value, rel=1e-3)


def test_entropy_and_report_row(logits):
    full, quant, mask = logits
    logp = torch.log_softmax(full.double() / 0.8, -1)
    expected = (-(logp.exp() * logp).sum(-1))[mask].mean().item()
    assert entropy(full, mask, temperature=0.8, chunk_size=3) == pytest.approx(expected, rel=1e-5)
    uniform = torch.zeros(2, 17)
    assert entropy(uniform) == pytest.approx(torch.log(torch.tensor(17.0)).item(), rel=1e-6)
    row = noise_report_row(full, quant, mask, step=3, sigma=1e-2)
    assert set(row) == {"step", "sigma", "entropy_quant", "entropy_full", "entropy_gain", "kl"}
    assert row["entropy_gain"] == pytest.approx(row["entropy_quant"] - row["entropy_full"])
    assert row["kl"] == pytest.approx(reference_kl(full, quant, mask), rel=1e-5)


def test_minus_inf_logits_are_finite():
    full = torch.tensor([[0.0, 1.0, -float("inf")]])
    assert entropy(full) == pytest.approx(
        -(torch.softmax(full[:, :2], -1) * torch.log_softmax(full[:, :2], -1)).sum().item())
    assert kl_full_vs_quant(full, full) == 0.0


def test_bad_inputs():
    x = torch.zeros(2, 3, 5)
    with pytest.raises(QerlConfigError, match="quant_logits"):
        kl_full_vs_quant(x, torch.zeros(2, 3, 4))
    with pytest.raises(QerlConfigError, match="mask"):
        entropy(x, torch.zeros(2, 3))
    with pytest.raises(QerlConfigError, match="mask"):
        entropy(x, torch.ones(3, 2))
