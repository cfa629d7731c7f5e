"""Held-out evaluation of the policy *with its adapter applied*: greedy pass@1 and sampled pass@k.

Correctness is decided by a reward function (by default the task's own verifier) reaching a
threshold, so evaluation and training agree on what "right" means -- and unlike the paper's
public evaluation script, the trained adapter is applied and the whole answer is verified.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from qerl.rewards.base import build_reward
from qerl.rewards.scoring import score_completions
from qerl.rollout.base import RolloutEngine, SamplingParams
from qerl.train.policy import Policy

if TYPE_CHECKING:
    from qerl.params import EvalParams, RolloutParams
from qerl.train.generate import decode_completions, encode_prompts


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def correctness(
    prompts: pd.DataFrame, completions: list[str], reward: dict[str, Any], threshold: float
) -> list[bool]:
    """``True`` where the correctness reward (unweighted) reaches ``threshold``."""
    wr = build_reward({**reward, "weight": 1.0}, "qerl.eval.correctness")
    cols = {
        "answer": prompts["answer"].astype(str).tolist(),
        "task": prompts["task"].astype(str).tolist(),
        "metadata": [json.loads(m) if isinstance(m, str) and m else {} for m in prompts["metadata"]],
    }
    res = score_completions([wr], prompts["prompt"].tolist(), completions, cols, on_error="zero")
    return [v >= threshold - 1e-9 for v in res.total]


def evaluate_policy(
    policy: Policy,
    prompts: pd.DataFrame,
    engine: RolloutEngine,
    *,
    k: int,
    temperature: float,
    max_new_tokens: int,
    max_prompt_tokens: int,
    reward: dict[str, Any],
    threshold: float,
    seed: int,
) -> tuple[dict[str, float], pd.DataFrame]:
    """Greedy pass@1 and sampled pass@k (n = k samples per prompt). Returns (summary, per-prompt table)."""
    ids, kept, _, _ = encode_prompts(policy, prompts["prompt"].tolist(), max_prompt_tokens, "truncate")
    prompts = prompts.iloc[kept].reset_index(drop=True)
    base = dict(max_new_tokens=max_new_tokens, eos_token_ids=policy.eos_token_ids, pad_token_id=policy.pad_token_id)
    greedy = engine.generate(policy.model, ids, SamplingParams(n=1, greedy=True, **base), None)
    g_text = _decode(policy, greedy)
    g_ok = correctness(prompts, g_text, reward, threshold)
    gen = torch.Generator().manual_seed(seed)
    sampled = engine.generate(policy.model, ids, SamplingParams(n=k, temperature=temperature, **base), gen)
    s_text = _decode(policy, sampled)
    s_ok = correctness(prompts.loc[prompts.index.repeat(k)].reset_index(drop=True), s_text, reward, threshold)
    per_prompt = pd.DataFrame(
        {
            "prompt_id": prompts["id"].astype(str),
            "prompt": prompts["prompt"],
            "answer": prompts["answer"].astype(str),
            "greedy_completion": g_text,
            "greedy_correct": g_ok,
            "samples_correct": [sum(s_ok[i * k : (i + 1) * k]) for i in range(len(prompts))],
        }
    )
    summary = {
        "n_prompts": len(prompts),
        "pass@1_greedy": float(per_prompt["greedy_correct"].mean()),
        f"pass@{k}": float(per_prompt["samples_correct"].map(lambda c: pass_at_k(k, c, k)).mean()),
        "pass@1_sampled": float(per_prompt["samples_correct"].mean() / k),
        "k": k,
    }
    return summary, per_prompt


def _decode(policy: Policy, batch: Any) -> list[str]:
    lengths = batch.completion_lengths.tolist()
    return decode_completions(policy, [row[:n].tolist() for row, n in zip(batch.completion_ids, lengths, strict=True)])


def evaluation_table(policy: Policy, prompts: pd.DataFrame, ev: EvalParams, rollout: RolloutParams, *,
                     stage: str, step: int) -> pd.DataFrame:
    """One evaluation row (``stage``: before / after): greedy pass@1, pass@k, sampled pass@1 on
    ``eval.max_prompts`` held-out prompts, with the policy's adapter applied."""
    from qerl.rollout import get_engine

    chosen = prompts if ev.max_prompts is None else prompts.head(ev.max_prompts)
    summary, _ = evaluate_policy(
        policy, chosen, get_engine(rollout.engine, policy.device), k=ev.k, temperature=ev.temperature,
        max_new_tokens=ev.max_new_tokens, max_prompt_tokens=rollout.max_prompt_tokens, reward=dict(ev.correctness),
        threshold=ev.threshold, seed=ev.seed,
    )
    return pd.DataFrame([{"stage": stage, "step": step, "format": policy.format, **summary}])
