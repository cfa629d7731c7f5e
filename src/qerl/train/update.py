"""Stage 5, the LoRA RL update: PPO-clipped GRPO/DAPO on the scored rollouts of one step.

One RL step = ``rl.epochs`` x ``rl.minibatches`` optimizer steps over the kept completions; each
optimizer step accumulates gradients over micro-batches of at most ``rl.micro_batch_tokens`` padded
tokens (rows sorted by length, so little compute goes to padding). The loss denominators are fixed
per optimizer step (:class:`~qerl.rl.objective.LossNorm`, TRL's convention), so the accumulated
gradient equals one pass over the union. Log-probs and entropies come from the decoder's hidden
states through the LM head in checkpointed chunks of ``rl.logprob_chunk_tokens`` positions: no
``[tokens, vocab]`` float32 tensor is ever alive, not even for the backward pass.

With ``rl.old_logprobs: recompute`` the PPO ratio's denominator is the trainer's log-prob on the
clean policy before the update (ratio exactly 1 on the first epoch), and ``rl.rollout_is`` weights
each token by the truncated/masked ``pi_old / pi_rollout`` for the rollout/trainer mismatch (the 4-bit
sampler's kernels and its AQN noise). The first optimizer step's forward runs on that clean policy,
so its rows take their denominators from its own detached log-probs; only the rows of the later
minibatches get a no-grad forward before it (none with one optimizer step per batch: a quarter of
the update's FLOPs saved; a quarter of that pass's with 4 minibatches) (:func:`fused_old_logprobs`).

Under ``torchrun`` (``qerl.train.distributed``) each rank holds the kept rows of its own prompts; the
global batch is their concatenation in rank order. The minibatches are drawn over that global batch,
the loss denominators count every rank's tokens and sequences, and the LoRA gradients are summed
over the ranks before clipping, so N ranks take the optimizer step one process would take.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from torch.utils.checkpoint import checkpoint

from qerl.rl.logprobs import k3_kl, token_logprobs_and_entropy
from qerl.rl.objective import LossNorm, policy_loss, rollout_is_weights
from qerl.train import distributed as dist
from qerl.train.metrics import step_row
from qerl.train.seeds import generator

if TYPE_CHECKING:
    from qerl.params import RLParams, RolloutParams
    from qerl.train.policy import Policy
    from qerl.train.state import TrainState

log = logging.getLogger(__name__)


#: Per-token statistics of ``policy_loss``, averaged over the optimizer step's tokens.
WEIGHTED = ("clip_ratio_low", "clip_ratio_high", "clip_ratio", "ratio_mean", "entropy")


class NonFiniteError(RuntimeError):
    """Raised after ``rl.max_bad_steps`` consecutive steps with NaN/inf loss or log-probs."""


# ------------------------------------------------------------------------------------ tensors


def padded(rows: list[list[float]], width: int, value: float = 0.0) -> torch.Tensor:
    """Right-pad variable-length rows into a float32 [N, width] tensor."""
    out = torch.full((len(rows), width), value, dtype=torch.float32)
    for i, r in enumerate(rows):
        if len(r):
            out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.float32)
    return out


def make_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device) -> dict[str, Any]:
    """Left-padded prompts + right-padded completions (completion logits are one slice)."""
    p_w = max(len(p) for p in prompts)
    c_w = max(1, max(len(c) for c in completions))
    n = len(prompts)
    ids = torch.full((n, p_w + c_w), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p_w + c_w), dtype=torch.long)
    mask = torch.zeros((n, c_w))
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, p_w - len(p): p_w] = torch.as_tensor(p)
        attn[i, p_w - len(p): p_w] = 1
        if c:
            ids[i, p_w: p_w + len(c)] = torch.as_tensor(c)
            attn[i, p_w: p_w + len(c)] = 1
            mask[i, : len(c)] = 1
    pos = (attn.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids.to(device), "attention_mask": attn.to(device), "position_ids": pos.to(device),
            "prompt_width": p_w, "mask": mask.to(device)}


def completion_logprobs(model: torch.nn.Module, batch: dict[str, Any], temperature: float,
                        chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies [N, T] of the completion tokens under ``model``.

    The decoder runs once; only the completion positions' hidden states go through the LM head,
    ``chunk_tokens`` at a time, each chunk checkpointed when autograd is on (its logits are
    recomputed in the backward pass instead of being kept).
    """
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder, head = hf.get_decoder(), hf.get_output_embeddings()
    p_w, mask = batch["prompt_width"], batch["mask"].bool()
    hidden = decoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"], use_cache=False).last_hidden_state
    c_w = mask.shape[1]
    h = hidden[:, p_w - 1: p_w - 1 + c_w][mask]  # [M, H], valid positions only
    tokens = batch["input_ids"][:, p_w: p_w + c_w][mask]
    softcap = getattr(hf.config, "final_logit_softcapping", None)

    def chunk_fn(hc: torch.Tensor, tc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(hc)
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        lp, ent = token_logprobs_and_entropy(logits.unsqueeze(0), tc.unsqueeze(0), temperature, chunk_size=None)
        return lp[0], ent[0]

    lps, ents = [], []
    for s in range(0, h.shape[0], chunk_tokens):
        hc, tc = h[s: s + chunk_tokens], tokens[s: s + chunk_tokens]
        lp, ent = checkpoint(chunk_fn, hc, tc, use_reentrant=False) if torch.is_grad_enabled() else chunk_fn(hc, tc)
        lps.append(lp)
        ents.append(ent)
    logp = torch.zeros(mask.shape, dtype=torch.float32, device=h.device)
    entropy = torch.zeros(mask.shape, dtype=torch.float32, device=h.device)
    if lps:
        logp = logp.masked_scatter(mask, torch.cat(lps))
        entropy = entropy.masked_scatter(mask, torch.cat(ents))
    return logp, entropy


def _width(rows: pd.DataFrame) -> int:
    """The longest completion of ``rows`` (at least 1; a rank may hold no kept rows)."""
    return max(1, int(rows["completion_tokens"].max())) if len(rows) else 1


def micro_batches(index: list[int], lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    """Split ``index`` into micro-batches of at most ``max_tokens`` padded tokens (rows x longest row),
    longest rows first, so rows of similar length share a micro-batch (``None``: one batch)."""
    order = sorted(index, key=lambda i: -lengths[i])
    if not max_tokens:
        return [order] if order else []
    out: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = lengths[cur[0]] if cur else lengths[i]  # sorted: the first row is the widest
        if cur and (len(cur) + 1) * width > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    if cur:
        out.append(cur)
    return out


def micro_batch_tokens(policy: Policy, rl: RLParams) -> int | None:
    """``rl.micro_batch_tokens``, with ``auto`` sized from the free accelerator memory (or what
    ``rl.memory_budget_gib`` leaves above the memory in use): activations per token are estimated from
    the model's shape (checkpointed layer inputs, or every layer's intermediates without
    checkpointing) plus an allowance of 2 x vocabulary x element size a token, and 60 % of that memory is
    used. The allowance is empirical: the LM head runs in checkpointed chunks, yet a 7B update on the H200
    used about 1.9 MB a token at 21 rows a micro-batch against 0.44 MB from the layer shapes (see
    docs/benchmarks.md); with it that run stayed inside its memory budget."""
    v = rl.micro_batch_tokens
    if v != "auto":
        return v
    if policy.device.type != "cuda":
        return None
    cfg = policy.model.get_base_model().config
    h, inter, layers = cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size), cfg.num_hidden_layers
    bytes_el = 2 if policy.dtype in (torch.bfloat16, torch.float16) else 4
    one_layer = (12 * h + 4 * inter) * bytes_el
    per_token = layers * h * bytes_el + one_layer if rl.gradient_checkpointing else layers * one_layer
    per_token += 2 * cfg.vocab_size * bytes_el  # measured allowance (docstring)
    free, _ = torch.cuda.mem_get_info(policy.device)
    # memory the allocator holds but no tensor uses (e.g. the rollout engine's released KV cache) is free too
    free += torch.cuda.memory_reserved(policy.device) - torch.cuda.memory_allocated(policy.device)
    if rl.memory_budget_gib is not None:
        free = min(free, rl.memory_budget_gib * 2**30 - torch.cuda.memory_allocated(policy.device))
    return max(256, int(0.6 * free / per_token))


# ------------------------------------------------------------------------------------ the step


def _sequence_forward(policy: Policy, rows: pd.DataFrame, idx: list[int], temperature: float, chunk: int, *,
                      adapter: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    batch = make_batch([rows.at[i, "prompt_ids"] for i in idx], [rows.at[i, "completion_ids"] for i in idx],
                       policy.pad_token_id, policy.device)
    temp = temperature
    if adapter:
        logp, ent = completion_logprobs(policy.model, batch, temp, chunk)
    else:
        with policy.model.disable_adapter():
            logp, ent = completion_logprobs(policy.model, batch, temp, chunk)
    return logp, ent, batch


@torch.no_grad()
def recompute_logprobs(policy: Policy, rows: pd.DataFrame, temperature: float, chunk: int, budget: int | None,
                       adapter: bool = True, only: list[int] | None = None) -> torch.Tensor:
    """No-grad trainer log-probs of the kept rows [N, T] (eval mode: no dropout); with ``only``, of
    those rows (the others stay 0)."""
    width = _width(rows)
    out = torch.zeros((len(rows), width))
    lengths = (rows["prompt_tokens"] + rows["completion_tokens"]).tolist()
    for mb in micro_batches(list(range(len(rows))) if only is None else list(only), lengths, budget):
        logp, _, _ = _sequence_forward(policy, rows, mb, temperature, chunk, adapter=adapter)
        out[mb, : logp.shape[1]] = logp.float().cpu()
    return out


def update_step(policy: Policy, state: TrainState, scored: pd.DataFrame, rl: RLParams,
                rollout: RolloutParams) -> dict[str, Any]:
    """The PPO-clipped LoRA update of one step (``rollout.temperature`` is the log-prob temperature,
    ``rollout.max_new_tokens`` dr_grpo's budget); returns the step's metrics row (``qerl.train.metrics``)."""
    t0 = time.perf_counter()
    fwd = (rollout.temperature, rl.logprob_chunk_tokens)
    step = int(scored["step"].iloc[0])
    rows = scored[scored["kept"]].reset_index(drop=True)
    counts = dist.all_gather_counts(len(rows))  # kept rows of each rank: the global batch, in rank order
    n_rows = sum(counts)
    stats: dict[str, float] = {}
    bad = False
    if n_rows:
        budget = micro_batch_tokens(policy, rl)
        width = _width(rows)
        rollout_lp = padded(list(rows["logprobs"]), width)
        mask = padded([[1.0] * n for n in rows["completion_tokens"]], width)
        order = torch.randperm(n_rows, generator=generator(rl.seed, step, "minibatch")).tolist()
        mb_size = math.ceil(n_rows / rl.minibatches)
        policy.model.eval()
        fused = fused_old_logprobs(rl)  # the first optimizer step fills its own rows (see the module docstring)
        filled = set(dist.local_indices(order[:mb_size], counts)) if fused else set()
        is_w = is_stats = None  # the importance weights and their statistics, once ``old`` is complete
        if rl.old_logprobs == "recompute":
            rest = [i for i in range(len(rows)) if i not in filled]
            old = recompute_logprobs(policy, rows, *fwd, budget, only=rest) if rest \
                else torch.zeros_like(rollout_lp)
            if not fused:
                is_w, is_stats = rollout_is_weights(old, rollout_lp, mask, rl.rollout_is, rl.rollout_is_cap)
        else:
            old = rollout_lp
        # LossNorm.of's denominators, counted over every rank: the batch's tokens per optimizer step
        batch_tokens = dist.all_sum({"tokens": float(mask.sum())})["tokens"]
        tokens_per_opt = max(batch_tokens, 1.0) / max(1, rl.minibatches)
        adv = torch.tensor(rows["advantage"].to_numpy(), dtype=torch.float32)
        lengths = (rows["prompt_tokens"] + rows["completion_tokens"]).tolist()
        saved = _save_update_state(policy, state) if rl.epochs * rl.minibatches > 1 else None
        per_opt: list[dict[str, float]] = []
        policy.model.train()
        for epoch in range(rl.epochs):
            for lo in range(0, n_rows, mb_size):
                minibatch = order[lo: lo + mb_size]  # global row numbers; this rank trains its own
                idx = dist.local_indices(minibatch, counts)
                mb_norm = LossNorm(tokens=tokens_per_opt, sequences=float(len(minibatch)),
                                   max_completion_length=rollout.max_new_tokens)
                fill = fused and epoch == 0 and lo == 0
                s = _optimizer_step(policy, state, rows, idx, lengths, budget, old, is_w, adv, mb_norm, rl, fwd,
                                    track_kl=(epoch == 0 and lo == 0), fill_old=rollout_lp if fill else None)
                if s is None:
                    bad = True
                    break
                if fill:  # ``old`` is complete now: the later steps' importance weights
                    is_w, is_stats = rollout_is_weights(old, rollout_lp, mask, rl.rollout_is, rl.rollout_is_cap)
                per_opt.append(s)
            if bad:
                break
        policy.model.eval()
        if per_opt or not fused:  # a skipped first step left its rows of ``old`` unfilled
            stats.update(dist.reduce_stats(mismatch_stats(old, rollout_lp, mask, is_stats), float(mask.sum())))
        if bad and saved is not None and per_opt:  # earlier optimizer steps were applied: undo them
            _restore_update_state(policy, state, saved)
        if not bad:
            stats.update(_mean(per_opt))
    _account_bad_step(state, bad, rl.max_bad_steps, step)
    stats["train/skipped_nonfinite"] = int(bad)
    stats["train/lr"] = state.optimizer.param_groups[0]["lr"] if state.optimizer else float("nan")
    return step_row(scored, stats, time.perf_counter() - t0, policy.device)


def fused_old_logprobs(rl: RLParams) -> bool:
    """Whether the first optimizer step's own forward (on the clean pre-update policy) gives its
    rows' PPO denominators (``recompute``); the other rows' come from a no-grad pass before it."""
    return rl.old_logprobs == "recompute"


def mismatch_stats(old: torch.Tensor, rollout_lp: torch.Tensor, mask: torch.Tensor,
                   is_stats: dict[str, float] | None = None) -> dict[str, float]:
    """The rollout/trainer mismatch of the batch: |old - rollout| log-prob gaps, with the
    importance-weight statistics ``rollout_is_weights`` gave for that ``old`` when the denominator is
    the trainer's (``recompute``; ``None`` otherwise)."""
    out: dict[str, float] = dict(is_stats or {})
    gap = ((old - rollout_lp).abs() * mask)
    out["mismatch/logprob_gap_mean"] = float(gap.sum() / mask.sum().clamp(min=1))
    out["mismatch/logprob_gap_max"] = float(gap.max()) if gap.numel() else 0.0
    return out


def _optimizer_step(policy: Policy, state: TrainState, rows: pd.DataFrame, idx: list[int], lengths: list[int],
                    budget: int | None, old: torch.Tensor, is_w: torch.Tensor | None, adv: torch.Tensor,
                    norm: LossNorm, rl: RLParams, fwd: tuple[float, int], track_kl: bool,
                    fill_old: torch.Tensor | None = None) -> dict[str, float] | None:
    """One optimizer step accumulated over micro-batches; None (weights untouched) on NaN/inf.

    ``fill_old`` (the rollout log-probs ``[N, T]``): this step's forward gives the PPO denominator;
    each micro-batch writes its detached log-probs into ``old`` and takes its importance weights
    from them and ``fill_old``."""
    state.optimizer.zero_grad(set_to_none=True)
    acc: dict[str, float] = {"train/loss": 0.0, "train/pg_loss": 0.0}
    weighted = dict.fromkeys(WEIGHTED, 0.0)
    kl = {"kl_sum": 0.0, "kl_tokens": 0.0, "kl_probed": 0.0}
    tokens = 0.0
    finite = True
    micros = micro_batches(idx, lengths, budget)
    for k, mb in enumerate(micros):
        logp, ent, batch = _sequence_forward(policy, rows, mb, *fwd)
        m = batch["mask"]
        c_w = m.shape[1]  # <= old's width: the longest completion of the micro-batch
        if fill_old is not None:
            old_mb = logp.detach().float()
            old[mb, :c_w] = old_mb.cpu()
            is_mb, _ = rollout_is_weights(old_mb, fill_old[mb][:, :c_w].to(m.device), m, rl.rollout_is, rl.rollout_is_cap)
        else:
            old_mb = old[mb][:, :c_w].to(m.device)
            is_mb = None if is_w is None else is_w[mb][:, :c_w].to(m.device)
        ref = None
        if rl.beta > 0 or (rl.track_kl and track_kl and k == 0):
            with torch.no_grad():
                ref, _, _ = _sequence_forward(policy, rows, mb, *fwd, adapter=False)
        loss, s = policy_loss(logp, old_mb, adv[mb].to(m.device), m, rl, norm,
                              ref_logprobs=ref if rl.beta > 0 else None, entropy=ent, is_weights=is_mb)
        if not torch.isfinite(loss) or not torch.isfinite(logp[m.bool()]).all():
            finite = False
            break
        loss.backward()
        n_tok = float(m.sum())
        tokens += n_tok
        acc["train/loss"] += s["loss"]
        acc["train/pg_loss"] += s["pg_loss"]
        for key in WEIGHTED:
            weighted[key] += s[key] * n_tok
        if ref is not None and k == 0:
            d = k3_kl(logp.detach(), ref)[m.bool()]
            kl = {"kl_sum": float(d.sum()), "kl_tokens": float(d.numel()), "kl_probed": 1.0}
    if dist.any_rank(not finite):  # every rank skips the step together
        state.optimizer.zero_grad(set_to_none=True)
        return None
    dist.all_reduce_grads(policy.lora_parameters())  # the whole batch's gradient on every rank
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.lora_parameters(), rl.max_grad_norm)
    if not torch.isfinite(grad_norm):
        state.optimizer.zero_grad(set_to_none=True)
        return None
    state.optimizer.step()
    state.scheduler.step()
    # the step's statistics over every rank: the loss shares add up, token means are token-weighted
    sums = dist.all_sum({**acc, **weighted, **kl, "tokens": tokens, "micro_batches": float(len(micros))})
    out = {"train/loss": sums["train/loss"], "train/pg_loss": sums["train/pg_loss"]}
    out.update({f"train/{k}": sums[k] / max(sums["tokens"], 1.0) for k in WEIGHTED})
    if sums["kl_probed"]:
        out["train/kl_to_base"] = sums["kl_sum"] / max(sums["kl_tokens"], 1.0)
    out.update({"train/grad_norm": float(grad_norm), "train/micro_batches": sums["micro_batches"]})
    return out


def _mean(stats: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for s in stats for k in s}
    out = {k: sum(s[k] for s in stats if k in s) / sum(1 for s in stats if k in s) for k in sorted(keys)}
    out["train/optimizer_steps"] = float(len(stats))
    return out


def _save_update_state(policy: Policy, state: TrainState) -> tuple[list[torch.Tensor], dict[str, Any], dict[str, Any] | None]:
    """Copies of the LoRA weights, optimizer and LR-scheduler state (a skipped step restores them)."""
    return ([p.detach().clone() for p in policy.lora_parameters()], copy.deepcopy(state.optimizer.state_dict()),
            copy.deepcopy(state.scheduler.state_dict()) if state.scheduler is not None else None)


def _restore_update_state(policy: Policy, state: TrainState, saved: tuple[list[torch.Tensor], dict[str, Any], dict[str, Any] | None]) -> None:
    params, optim, sched = saved
    with torch.no_grad():
        for p, value in zip(policy.lora_parameters(), params, strict=True):
            p.copy_(value)
    state.optimizer.load_state_dict(optim)  # restores the param groups' lr too
    if sched is not None:
        state.scheduler.load_state_dict(sched)


def _account_bad_step(state: TrainState, bad: bool, limit: int, step: int) -> None:
    if not bad:
        state.bad_steps_in_row = 0
        return
    state.bad_steps_in_row += 1
    state.bad_steps_total += 1
    log.warning("step %d: non-finite loss/log-probs/gradients, update skipped (%d in a row, limit rl.max_bad_steps=%d)",
                step, state.bad_steps_in_row, limit)
    if state.bad_steps_in_row >= limit:
        raise NonFiniteError(
            f"{state.bad_steps_in_row} consecutive steps had NaN/inf loss or log-probs (rl.max_bad_steps={limit}); "
            "lower rl.lr, check the reward scale, or raise rl.max_bad_steps")
