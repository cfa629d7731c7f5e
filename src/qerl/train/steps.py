"""One RL step in three stages, each usable on its own (Kedro nodes wrap them one to one):

1. :func:`rollout_step` -- sample G completions per prompt from the 4-bit policy with its live
   adapter and the step's AQN noise; returns the *rollouts table* (one row per completion).
2. :func:`score_step` -- reward functions + group-normalised advantages; returns the table with
   ``reward``, ``reward_<fn>`` and ``advantage`` columns.
3. :func:`update_step` -- PPO-clipped LoRA update over minibatches/epochs; returns the step's
   metrics row.

Tables are plain pandas DataFrames so every stage's output can be persisted, inspected and
re-used (a rollout rerun, a re-scoring with another reward) without the others.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import resource
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from qerl.noise.aqn import aqn_noise
from qerl.rl.objective import (
    ObjectiveConfig,
    dynamic_sampling_mask,
    group_advantages,
    policy_loss,
    token_logprobs_and_entropy,
)
from qerl.rollout.base import RolloutEngine, SamplingParams
from qerl.train.policy import Policy
from qerl.train.state import TrainState

log = logging.getLogger(__name__)

PROMPT_COLUMNS = ("id", "prompt", "answer", "task", "metadata")


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    max_prompt_tokens: int = 256
    overlong_prompt: str = "truncate"  # or "drop"


@dataclass(frozen=True)
class UpdateConfig:
    objective: ObjectiveConfig
    epochs: int = 1
    minibatches: int = 1
    max_grad_norm: float = 0.2
    track_kl: bool = True
    max_bad_steps: int = 3
    seed: int = 0


class NonFiniteError(RuntimeError):
    """Raised after ``max_bad_steps`` consecutive steps with NaN/inf loss or log-probs."""


def select_prompts(prompts: pd.DataFrame, step: int, per_step: int, seed: int) -> pd.DataFrame:
    """The prompts of step ``step`` (1-based): consecutive slices of a per-epoch seeded permutation.

    A pure function of (table, step, per_step, seed), so a resumed run or a single-node rerun
    sees exactly the prompts the original run saw at that step.
    """
    n = len(prompts)
    start = (step - 1) * per_step
    rows = []
    for pos in range(start, start + per_step):
        epoch, offset = divmod(pos, n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
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


def rollout_step(
    policy: Policy,
    prompts: pd.DataFrame,
    step: int,
    sigma: float,
    cfg: RolloutConfig,
    engine: RolloutEngine,
    seed: int,
) -> pd.DataFrame:
    """Generate ``cfg.group_size`` completions for each prompt; return the rollouts table."""
    ids, kept, n_trunc, n_drop = encode_prompts(policy, list(prompts["prompt"]), cfg.max_prompt_tokens, cfg.overlong_prompt)
    if not kept:
        raise ValueError(
            f"rollout.max_prompt_tokens={cfg.max_prompt_tokens}: every prompt of step {step} is longer and "
            "rollout.overlong_prompt=drop removed them all; raise max_prompt_tokens or use truncate"
        )
    prompts = prompts.iloc[kept].reset_index(drop=True)
    sampling = SamplingParams(
        n=cfg.group_size,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        eos_token_ids=policy.eos_token_ids,
        pad_token_id=policy.pad_token_id,
    )
    gen = torch.Generator().manual_seed(_mix(seed, step, 1))
    noise_gen = torch.Generator(device=policy.device).manual_seed(_mix(seed, step, 2))
    t0 = time.perf_counter()
    with aqn_noise(policy.model, sigma, noise_gen):
        batch = engine.generate(policy.model, ids, sampling, gen)
    _sync(policy.device)
    seconds = time.perf_counter() - t0
    return _rollouts_table(policy, prompts, batch, step, sigma, seconds, n_trunc, n_drop)


def _rollouts_table(
    policy: Policy, prompts: pd.DataFrame, batch: Any, step: int, sigma: float, seconds: float, n_trunc: int, n_drop: int
) -> pd.DataFrame:
    lengths = batch.completion_lengths.tolist()
    comp_ids = [row[:n].tolist() for row, n in zip(batch.completion_ids, lengths, strict=False)]
    logps = [row[:n].tolist() for row, n in zip(batch.logprobs, lengths, strict=False)]
    ent = batch.extras.get("entropy")
    texts = decode_completions(policy, comp_ids)
    idx = batch.prompt_index.tolist()
    src = prompts.iloc[idx].reset_index(drop=True)
    table = pd.DataFrame(
        {
            "step": step,
            "prompt_id": src["id"].astype(str),
            "sample": [i % max(1, len(idx) // max(1, len(prompts))) for i in range(len(idx))],
            "prompt": src["prompt"],
            "completion": texts,
            "prompt_ids": [list(p) for p in batch.prompt_ids],
            "completion_ids": comp_ids,
            "logprobs": logps,
            "prompt_tokens": [len(p) for p in batch.prompt_ids],
            "completion_tokens": lengths,
            "truncated": batch.truncated.tolist(),
            "sum_logprob": [float(sum(lp)) for lp in logps],
            "mean_entropy": [
                float(ent[i, :n].mean()) if ent is not None and n else float("nan") for i, n in enumerate(lengths)
            ],
            "sigma": sigma,
            "answer": src["answer"].astype(str),
            "task": src["task"].astype(str) if "task" in src else "",
            "metadata": src["metadata"].astype(str) if "metadata" in src else "{}",
            "generate_seconds": seconds,
            "prompts_truncated": n_trunc,
            "prompts_dropped": n_drop,
        }
    )
    return table


def decode_completions(policy: Policy, completion_ids: list[list[int]]) -> list[str]:
    """Completion texts with the EOS / pad markers removed (the format tags are kept)."""
    texts = policy.tokenizer.batch_decode(completion_ids, skip_special_tokens=False)
    for tok in (policy.tokenizer.eos_token, policy.tokenizer.pad_token):
        if tok:
            texts = [t.replace(tok, "") for t in texts]
    return texts


def score_step(
    rollouts: pd.DataFrame,
    reward_fns: list[tuple[str, Any, float]],
    group_size: int,
    scale_by_std: bool = True,
    dynamic_sampling: bool = False,
    on_error: str = "raise",
) -> pd.DataFrame:
    """Add ``reward_<fn>``, ``reward``, ``advantage`` and ``kept`` columns (one group = one prompt)."""
    from qerl.rewards.base import score_completions

    t0 = time.perf_counter()
    columns = {c: rollouts[c].tolist() for c in ("answer", "task", "metadata", "completion_tokens") if c in rollouts}
    if "metadata" in columns:  # a table without metadata (e.g. re-scoring a hand-made one) passes none
        columns["metadata"] = [
            json.loads(m) if isinstance(m, str) and m else (m if isinstance(m, dict) else {}) for m in columns["metadata"]
        ]
    total, per_fn, n_errors = score_completions(
        reward_fns, rollouts["prompt"].tolist(), rollouts["completion"].tolist(), columns, on_error=on_error
    )
    out = rollouts.copy()
    for name, values in per_fn.items():
        out[f"reward_{name}"] = values
    out["reward"] = total
    rewards = torch.tensor(total, dtype=torch.float32)
    out["advantage"] = group_advantages(rewards, group_size, scale_by_std=scale_by_std).tolist()
    keep = dynamic_sampling_mask(rewards, group_size) if dynamic_sampling else torch.ones(len(out), dtype=torch.bool)
    out["kept"] = keep.tolist()
    out["reward_errors"] = sum(n_errors.values())
    out["score_seconds"] = time.perf_counter() - t0
    return out


def update_step(policy: Policy, state: TrainState, scored: pd.DataFrame, cfg: UpdateConfig, temperature: float) -> dict[str, Any]:
    """PPO-clipped update of the LoRA weights on the step's scored rollouts; returns the metrics row."""
    t0 = time.perf_counter()
    rows = scored[scored["kept"]].reset_index(drop=True)
    metrics = _rollout_metrics(scored)
    stats: list[dict[str, float]] = []
    bad = False
    if len(rows):
        model = policy.model
        model.train()
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(_mix(cfg.seed, state.step + 1, 3)))
        mb_size = math.ceil(len(rows) / cfg.minibatches)
        # several optimizer steps per RL step: keep what a non-finite minibatch must roll back
        saved = _save_update_state(policy, state) if cfg.epochs * math.ceil(len(rows) / mb_size) > 1 else None
        for epoch in range(cfg.epochs):
            for lo in range(0, len(rows), mb_size):
                mb = rows.iloc[order[lo : lo + mb_size].tolist()]
                s = _minibatch_update(policy, state, mb, cfg, temperature, first=(epoch == 0 and lo == 0))
                if s is None:
                    bad = True
                    break
                stats.append(s)
            if bad:
                break
        if bad and saved is not None and stats:  # earlier minibatches were applied: undo them
            _restore_update_state(policy, state, saved)
        if bad:
            stats = []
        model.eval()
    metrics.update(_mean_stats(stats))
    _account_bad_step(state, bad, cfg.max_bad_steps)
    metrics.update(
        {
            "skipped_nonfinite": int(bad),
            "lr": state.optimizer.param_groups[0]["lr"] if state.optimizer else float("nan"),
            "t_update": time.perf_counter() - t0,
            "peak_mem_gib": _peak_memory_gib(policy.device),
            "groups_kept": int(scored["kept"].sum()) // max(1, _group_size(scored)),
        }
    )
    return metrics


def _save_update_state(policy: Policy, state: TrainState) -> tuple[list[torch.Tensor], dict[str, Any], dict[str, Any] | None]:
    """Copies of the LoRA weights, optimizer and LR-scheduler state (a skipped step restores them)."""
    return (
        [p.detach().clone() for p in policy.lora_parameters()],
        copy.deepcopy(state.optimizer.state_dict()),
        copy.deepcopy(state.scheduler.state_dict()) if state.scheduler is not None else None,
    )


def _restore_update_state(policy: Policy, state: TrainState, saved: tuple[list[torch.Tensor], dict[str, Any], dict[str, Any] | None]) -> None:
    params, optim, sched = saved
    with torch.no_grad():
        for p, value in zip(policy.lora_parameters(), params, strict=True):
            p.copy_(value)
    state.optimizer.load_state_dict(optim)  # restores the param groups' lr too
    if sched is not None:
        state.scheduler.load_state_dict(sched)


def _minibatch_update(
    policy: Policy, state: TrainState, mb: pd.DataFrame, cfg: UpdateConfig, temperature: float, first: bool
) -> dict[str, float] | None:
    """One optimizer step on a minibatch. Returns None (and leaves the weights alone) on NaN/inf."""
    batch = make_batch(mb, policy.pad_token_id, policy.device)
    logp, entropy = sequence_logprobs(policy.model, batch, temperature)
    ref = None
    if cfg.objective.beta > 0 or (cfg.track_kl and first):
        with torch.no_grad(), policy.model.disable_adapter():
            ref, _ = sequence_logprobs(policy.model, batch, temperature)
    loss, s = policy_loss(
        logp,
        batch["old_logprobs"],
        batch["advantages"],
        batch["mask"],
        cfg.objective,
        ref_logprobs=ref if cfg.objective.beta > 0 else None,
        entropy=entropy,
    )
    if not torch.isfinite(loss) or not torch.isfinite(logp[batch["mask"].bool()]).all():
        state.optimizer.zero_grad(set_to_none=True)
        return None
    state.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.lora_parameters(), cfg.max_grad_norm)
    if not torch.isfinite(grad_norm):
        state.optimizer.zero_grad(set_to_none=True)
        return None
    state.optimizer.step()
    state.scheduler.step()
    s = dict(s)
    s.update({"loss": float(loss.detach()), "grad_norm": float(grad_norm)})
    if first:
        m = batch["mask"].bool()
        gap = (logp.detach() - batch["old_logprobs"]).abs()[m]
        s["logprob_gap_mean"] = float(gap.mean()) if gap.numel() else 0.0
        s["logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
        if ref is not None and cfg.track_kl:
            d = (ref - logp.detach())[m]
            s["kl_to_base"] = float((d.exp() - d - 1).mean()) if d.numel() else 0.0
    return s


def make_batch(rows: pd.DataFrame, pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Left-padded prompts + right-padded completions, so completion logits are one slice."""
    prompts = [list(p) for p in rows["prompt_ids"]]
    comps = [list(c) for c in rows["completion_ids"]]
    p_w = max(len(p) for p in prompts)
    c_w = max(1, max(len(c) for c in comps))
    n = len(rows)
    ids = torch.full((n, p_w + c_w), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p_w + c_w), dtype=torch.long)
    mask = torch.zeros((n, c_w))
    old = torch.zeros((n, c_w))
    for i, (p, c, lp) in enumerate(zip(prompts, comps, rows["logprobs"], strict=False)):
        ids[i, p_w - len(p) : p_w] = torch.tensor(p)
        attn[i, p_w - len(p) : p_w] = 1
        if c:
            ids[i, p_w : p_w + len(c)] = torch.tensor(c)
            attn[i, p_w : p_w + len(c)] = 1
            mask[i, : len(c)] = 1
            old[i, : len(c)] = torch.tensor(list(lp), dtype=torch.float32)
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    return {
        "input_ids": ids.to(device),
        "attention_mask": attn.to(device),
        "position_ids": pos.to(device),
        "prompt_width": torch.tensor(p_w),
        "mask": mask.to(device),
        "old_logprobs": old.to(device),
        "advantages": torch.tensor(rows["advantage"].to_numpy(), dtype=torch.float32, device=device),
    }


def sequence_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (and entropies) of the completion tokens under ``model``: [N, T]."""
    p_w = int(batch["prompt_width"])
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    c_w = batch["mask"].shape[1]
    logits = out.logits[:, p_w - 1 : p_w - 1 + c_w].float()
    tokens = batch["input_ids"][:, p_w : p_w + c_w]
    return token_logprobs_and_entropy(logits, tokens, temperature)


def _rollout_metrics(scored: pd.DataFrame) -> dict[str, Any]:
    g = _group_size(scored)
    rewards = torch.tensor(scored["reward"].to_numpy(), dtype=torch.float32)
    groups = rewards.view(-1, g) if len(rewards) % g == 0 else rewards.view(1, -1)
    gen_s = float(scored["generate_seconds"].iloc[0])
    n_tok = int(scored["completion_tokens"].sum())
    m: dict[str, Any] = {
        "step": int(scored["step"].iloc[0]),
        "sigma": float(scored["sigma"].iloc[0]),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "zero_std_group_frac": float((groups.std(dim=1) == 0).float().mean()) if groups.shape[1] > 1 else 1.0,
        "completion_len_mean": float(scored["completion_tokens"].mean()),
        "completion_len_max": int(scored["completion_tokens"].max()),
        "truncated_ratio": float(scored["truncated"].mean()),
        "entropy": float(np.nanmean(scored["mean_entropy"])) if scored["mean_entropy"].notna().any() else float("nan"),
        "t_generate": gen_s,
        "t_score": float(scored["score_seconds"].iloc[0]),
        "tokens_per_s": n_tok / gen_s if gen_s > 0 else float("nan"),
        "prompts_truncated": int(scored["prompts_truncated"].iloc[0]),
        "prompts_dropped": int(scored["prompts_dropped"].iloc[0]),
        "reward_errors": int(scored["reward_errors"].iloc[0]),
    }
    for col in scored.columns:
        if col.startswith("reward_") and col not in ("reward_errors",):
            vals = pd.to_numeric(scored[col], errors="coerce")
            m[f"{col}_mean"] = float(vals.mean()) if vals.notna().any() else float("nan")
    return m


def _group_size(scored: pd.DataFrame) -> int:
    # from the sample index, not from prompt ids: a step may draw the same prompt twice (a slice that
    # straddles an epoch boundary of select_prompts, or prompts_per_step > number of prompts)
    if "sample" in scored and len(scored):
        return int(scored["sample"].max()) + 1
    counts = scored.groupby("prompt_id", sort=False).size()
    return int(counts.iloc[0]) if len(counts) else 1


def _mean_stats(stats: list[dict[str, float]]) -> dict[str, float]:
    if not stats:
        return {}
    keys = {k for s in stats for k in s}
    return {k: float(np.mean([s[k] for s in stats if k in s])) for k in sorted(keys)}


def _account_bad_step(state: TrainState, bad: bool, limit: int) -> None:
    if not bad:
        state.bad_steps_in_row = 0
        return
    state.bad_steps_in_row += 1
    state.bad_steps_total += 1
    log.warning(
        "step %d: non-finite loss/log-probs/gradients, update skipped (%d in a row, limit rl.max_bad_steps=%d)",
        state.step + 1, state.bad_steps_in_row, limit,
    )
    if state.bad_steps_in_row >= limit:
        raise NonFiniteError(
            f"{state.bad_steps_in_row} consecutive steps had NaN/inf loss or log-probs (rl.max_bad_steps={limit}); "
            "lower rl.lr, check the reward scale, or raise rl.max_bad_steps"
        )


def _peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mix(*parts: int) -> int:
    """A deterministic 62-bit seed from integers (so step seeds do not collide across purposes)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 2)
