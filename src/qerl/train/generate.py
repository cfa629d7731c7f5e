"""Stage 3, rollout generation: sample G completions per prompt from the 4-bit policy with its
live adapter and the step's AQN noise, as the *rollouts table* (one row per completion).

The table is a plain DataFrame (persisted by the catalog, re-scorable, inspectable). Prompt order,
sampling and noise are each drawn from ``rl.seed`` and the step (``qerl.train.seeds``), so a resumed
run or a replay of step s sees exactly what the original run saw there. Under ``torchrun`` (a process
group, any number of ranks) each prompt samples from its own stream, drawn from the seed, the step and
the prompt's number in the step, so N ranks sampling their shards generate what one rank generates for
the whole step (a plain process samples the step from one stream: with the hf engine that is one
batched ``generate`` instead of one per prompt).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from qerl.errors import QerlConfigError
from qerl.noise.aqn import aqn_noise
from qerl.rollout import get_engine
from qerl.rollout.base import RolloutEngine, SamplingParams
from qerl.train import distributed as dist
from qerl.train.seeds import derive_seed, generator

if TYPE_CHECKING:
    from qerl.params import RolloutParams
    from qerl.train.policy import Policy

log = logging.getLogger(__name__)


def select_prompts(prompts: pd.DataFrame, step: int, per_step: int, seed: int) -> pd.DataFrame:
    """The prompts of step ``step`` (1-based): consecutive slices of a per-epoch seeded permutation.

    A pure function of (table, step, per_step, seed), so a resumed run or a single-node rerun
    sees exactly the prompts the original run saw at that step.
    """
    n = len(prompts)
    if n == 0:
        raise QerlConfigError("train_prompts", "the training prompt table is empty", "check data.sources")
    rows = []
    for pos in range((step - 1) * per_step, step * per_step):
        epoch, offset = divmod(pos, n)
        perm = np.random.default_rng(derive_seed(seed, epoch, "prompts")).permutation(n)
        rows.append(perm[offset])
    return prompts.iloc[rows].reset_index(drop=True)


def encode_prompts(
    policy: Policy, texts: list[str], max_tokens: int, overlong: str
) -> tuple[list[list[int]], list[int], int, int]:
    """Tokenize prompts; over-long ones are left-truncated (keep the end) or dropped, and counted.

    Returns (token lists, indices of kept prompts, n_truncated, n_dropped).
    """
    ids, kept, n_trunc, n_drop = [], [], 0, 0
    for i, text in enumerate(texts):
        toks = policy.tokenizer(text, add_special_tokens=True)["input_ids"]
        if len(toks) > max_tokens:
            if overlong == "drop":
                n_drop += 1
                continue
            toks = toks[-max_tokens:]
            n_trunc += 1
        ids.append(list(toks))
        kept.append(i)
    return ids, kept, n_trunc, n_drop


def decode_completions(policy: Policy, completion_ids: list[list[int]]) -> list[str]:
    """Completion texts with the EOS / pad markers removed (the format tags are kept)."""
    texts = policy.tokenizer.batch_decode(completion_ids, skip_special_tokens=False)
    for tok in (policy.tokenizer.eos_token, policy.tokenizer.pad_token):
        if tok:
            texts = [t.replace(tok, "") for t in texts]
    return texts


def sampling_generators(seed: int, step: int, numbers: list[int]) -> torch.Generator | list[torch.Generator]:
    """The sampling stream of a step: one per prompt (``numbers``: their places in the step) under
    ``torchrun``, one for the whole batch otherwise (see the module docstring)."""
    if dist.initialized():
        return [generator(seed, step, "sampling", index=i) for i in numbers]
    return generator(seed, step, "sampling")


def rollout_step(
    policy: Policy, prompts: pd.DataFrame, step: int, sigma: float, rollout: RolloutParams, seed: int,
    engine: RolloutEngine | None = None, first: int = 0,
) -> pd.DataFrame:
    """Sample ``rollout.group_size`` completions for each of ``prompts`` at noise level ``sigma``
    (sampling and noise drawn from ``seed`` and ``step``; ``first``: the step's number of ``prompts``'
    first row, when they are a rank's shard of the step)."""
    r = rollout
    ids, kept, n_trunc, n_drop = encode_prompts(policy, list(prompts["prompt"]), r.max_prompt_tokens, r.overlong_prompt)
    if n_trunc or n_drop:
        log.warning("step %d: %d prompt(s) longer than rollout.max_prompt_tokens=%d were %s",
                    step, n_trunc + n_drop, r.max_prompt_tokens, "dropped" if n_drop else "truncated (the end kept)")
    if not kept:
        raise QerlConfigError(
            "rollout.max_prompt_tokens", f"every prompt of step {step} is longer than {r.max_prompt_tokens} tokens and "
            "rollout.overlong_prompt=drop removed them all", "raise max_prompt_tokens or use truncate")
    return sample_rollouts(policy, prompts.iloc[kept].reset_index(drop=True), ids, step, sigma, r, seed, engine,
                           [first + i for i in kept], n_trunc, n_drop)


def sample_rollouts(
    policy: Policy, prompts: pd.DataFrame, ids: list[list[int]], step: int, sigma: float, rollout: RolloutParams,
    seed: int, engine: RolloutEngine | None = None, rows: list[int] | None = None, n_trunc: int = 0, n_drop: int = 0,
    eos_token_ids: tuple[int, ...] | None = None,
) -> pd.DataFrame:
    """The sampling half of :func:`rollout_step` for prompts already encoded (``ids``, one per row of
    ``prompts``; ``rows``: their numbers in the step, for the per-prompt sampling draws): AQN noise on,
    ``rollout.group_size`` completions each, the rollouts table. ``eos_token_ids`` overrides the
    policy's (``()``: fixed-length completions, as the benchmarks use)."""
    r = rollout
    eos = policy.eos_token_ids if eos_token_ids is None else eos_token_ids
    sampling = SamplingParams(n=r.group_size, temperature=r.temperature, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                              eos_token_ids=eos, pad_token_id=policy.pad_token_id)
    engine = engine or get_engine(r.engine, policy.device, r.kv_budget_gib, r.single_weight_copy)
    rows = list(range(len(ids))) if rows is None else rows
    t0 = time.perf_counter()
    with aqn_noise(policy.model, sigma, generator(seed, step, "aqn", policy.device)) as noise:
        batch = engine.generate(policy.model, ids, sampling, sampling_generators(seed, step, rows))
    if policy.device.type == "cuda":
        torch.cuda.synchronize(policy.device)
    seconds = time.perf_counter() - t0
    return rollouts_table(policy, prompts, batch, step, sigma, seconds, n_trunc, n_drop, noise.changed_fraction)


def rollouts_table(
    policy: Policy, prompts: pd.DataFrame, batch: Any, step: int, sigma: float, seconds: float, n_trunc: int,
    n_drop: int, noise_changed: float = 0.0,
) -> pd.DataFrame:
    """One row per completion: ids, log-probs and entropies of the sampling policy, timings."""
    lengths = batch.completion_lengths.tolist()
    comp_ids = [row[:n].tolist() for row, n in zip(batch.completion_ids, lengths, strict=True)]
    logps = [row[:n].tolist() for row, n in zip(batch.logprobs, lengths, strict=True)]
    ent = batch.extras.get("entropy")
    idx = batch.prompt_index.tolist()
    group = max(1, len(idx) // max(1, len(prompts)))
    src = prompts.iloc[idx].reset_index(drop=True)
    return pd.DataFrame({
        "step": step,
        "prompt_id": src["id"].astype(str),
        "sample": [i % group for i in range(len(idx))],
        "prompt": src["prompt"],
        "completion": decode_completions(policy, comp_ids),
        "prompt_ids": [list(p) for p in batch.prompt_ids],
        "completion_ids": comp_ids,
        "logprobs": logps,
        "prompt_tokens": [len(p) for p in batch.prompt_ids],
        "completion_tokens": lengths,
        "truncated": batch.truncated.tolist(),
        "sum_logprob": [float(sum(lp)) for lp in logps],
        "mean_entropy": [float(ent[i, :n].mean()) if ent is not None and n else float("nan") for i, n in enumerate(lengths)],
        "sigma": sigma,
        "noise_changed_fraction": noise_changed,
        "answer": src["answer"].astype(str),
        "task": src["task"].astype(str) if "task" in src else "",
        "metadata": src["metadata"].astype(str) if "metadata" in src else "{}",
        "generate_seconds": seconds,
        "prompts_truncated": n_trunc,
        "prompts_dropped": n_drop,
    })
