"""The noise monitor: how far is each 4-bit policy from full precision, and how much flatter?

On a fixed probe set (prompt + the full-precision model's greedy completion, teacher-forced), for
each requested format it reports KL(P_full || P_quant), the entropy of both and the entropy gain,
for the quantized base alone, the base with AQN noise at ``sigma``, and (for the training format)
the trained policy with its adapter. The full-precision model is loaded here, used, and freed:
it is never resident during training.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import pandas as pd
import torch

from qerl.modeling.loader import load_policy_base
from qerl.noise.aqn import aqn_noise
from qerl.noise.metrics import noise_report_row
from qerl.rollout.base import SamplingParams
from qerl.rollout.hf import HFGenerateEngine, left_pad
from qerl.train.policy import Policy


@torch.no_grad()
def probe_logits(model: torch.nn.Module, seqs: list[list[int]], n_prompt: list[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [N, L, V] (float32, CPU) of left-padded ``seqs`` and the mask of completion positions."""
    device = next(model.parameters()).device
    ids, attn = left_pad(seqs, pad_id, device)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.float().cpu()
    width = ids.shape[1]
    mask = torch.zeros(ids.shape[0], width)
    for i, (s, p) in enumerate(zip(seqs, n_prompt, strict=False)):
        start = width - len(s)
        # logits at position t predict token t+1: completion tokens are predicted from p-1 .. len-2
        mask[i, start + p - 1 : width - 1] = 1
    return logits, mask


def build_probe(fp_model: torch.nn.Module, tokenizer: Any, prompts: list[str], max_new_tokens: int, eos: tuple[int, ...], pad: int) -> tuple[list[list[int]], list[int]]:
    """Probe sequences: each prompt followed by the full-precision model's greedy completion."""
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    sp = SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens, eos_token_ids=eos, pad_token_id=pad)
    out = HFGenerateEngine().generate(fp_model, ids, sp)
    seqs = [p + row[:n].tolist() for p, row, n in zip(ids, out.completion_ids, out.completion_lengths.tolist(), strict=False)]
    return seqs, [len(p) for p in ids]


def noise_report(
    policy: Policy,
    prompts: list[str],
    formats: list[str],
    sigma: float,
    max_new_tokens: int,
    seed: int = 0,
) -> pd.DataFrame:
    """One row per (format, variant): kl, entropy_quant, entropy_full, entropy_gain."""
    path, quant = policy.model_settings.path, policy.quant
    pad, eos = policy.pad_token_id, policy.eos_token_ids
    fp_model, tok, _ = load_policy_base(path, "none", device=policy.device, compute_dtype=torch.float32)
    seqs, n_prompt = build_probe(fp_model, tok, prompts, max_new_tokens, eos, pad)
    full, mask = probe_logits(fp_model, seqs, n_prompt, pad)
    del fp_model
    _free()
    rows = []
    for fmt in dict.fromkeys([quant.format, *formats]):
        if fmt == quant.format:
            model, owner = policy.model, None
        else:
            owner, _, _ = load_policy_base(path, fmt, device=policy.device, compute_dtype=policy.dtype,
                                           skip_modules=quant.skip_modules, on_indivisible=quant.on_indivisible)
            model = owner
        rows += _format_rows(model, fmt, full, mask, seqs, n_prompt, pad, sigma, seed, trained=owner is None)
        del model, owner
        _free()
    return pd.DataFrame(rows)


def _format_rows(model: torch.nn.Module, fmt: str, full: torch.Tensor, mask: torch.Tensor, seqs: list[list[int]], n_prompt: list[int], pad: int, sigma: float, seed: int, trained: bool) -> list[dict[str, Any]]:
    def row(variant: str, logits: torch.Tensor, s: float) -> dict[str, Any]:
        r = noise_report_row(full, logits, mask)
        return {"format": fmt, "variant": variant, "sigma": s, "n_tokens": int(mask.sum()), **r}

    out = []
    ctx = model.disable_adapter() if trained else contextlib.nullcontext()
    with ctx:
        base = probe_logits(model, seqs, n_prompt, pad)[0]
        out.append(row("quantized base", base, 0.0))
        if sigma > 0:
            gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
            with aqn_noise(model, sigma, gen):
                noisy = probe_logits(model, seqs, n_prompt, pad)[0]
            out.append(row("quantized base + AQN", noisy, sigma))
    if trained:
        out.append(row("trained policy (adapter on)", probe_logits(model, seqs, n_prompt, pad)[0], 0.0))
    return out


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
