"""The reference rollout engine: transformers ``generate`` on any causal LM (quantized or not, with a
peft adapter or not). Works on CPU and GPU; the fast GPU engine (``qerl.rollout.fast``) must agree
with it.
"""

from __future__ import annotations

import torch

from qerl.rl.logprobs import token_logprobs_and_entropy
from qerl.rollout.base import RolloutBatch, SamplingParams


def left_pad(prompt_ids: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(input_ids, attention_mask)`` of shape [B, max_len]."""
    width = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompt_ids), width), dtype=torch.long)
    for i, p in enumerate(prompt_ids):
        if p:
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def completion_mask(tokens: torch.Tensor, eos_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real completion tokens (up to and including the first EOS) and the truncated flags."""
    if not eos_ids:
        return torch.ones_like(tokens, dtype=torch.float32), torch.ones(tokens.shape[0], dtype=torch.bool)
    is_eos = torch.zeros_like(tokens, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= tokens == e
    # number of EOS seen strictly before each position
    before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    mask = (before == 0).float()
    truncated = ~is_eos.any(dim=1)
    return mask, truncated


class HFGenerateEngine:
    """Sampling with ``model.generate``; log-probs recomputed from the raw logits it returns."""

    name = "hf"

    def __init__(self, batch_size: int | None = None) -> None:
        self.batch_size = batch_size

    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        generator: torch.Generator | list[torch.Generator] | None = None,
    ) -> RolloutBatch:
        device = next(model.parameters()).device
        if isinstance(generator, (list, tuple)):  # one call per prompt, each seeded by its own generator
            jobs = [((i, i + 1), g) for i, g in enumerate(generator)]
        else:  # chunks of batch_size prompts drawing from one seeded stream
            chunks = _chunks(len(prompt_ids), self.batch_size or len(prompt_ids))
            jobs = [(c, generator if k == 0 else None) for k, c in enumerate(chunks)]
        parts = []
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            for (lo, hi), g in jobs:
                if g is not None:
                    torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=g).item()))
                parts.append(self._generate_chunk(model, prompt_ids[lo:hi], sampling, device, lo))
        return _concat(parts, sampling.pad_token_id)

    def _generate_chunk(
        self, model: torch.nn.Module, prompts: list[list[int]], sp: SamplingParams, device: torch.device, offset: int
    ) -> RolloutBatch:
        ids, attn = left_pad(prompts, sp.pad_token_id, device)
        n_return = sp.n
        if sp.greedy and sp.n > 1:
            # transformers refuses num_return_sequences > 1 without sampling: repeat the rows instead
            ids, attn = ids.repeat_interleave(sp.n, dim=0), attn.repeat_interleave(sp.n, dim=0)
            n_return = 1
        was_training = model.training
        model.eval()
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=not sp.greedy,
            temperature=sp.temperature if not sp.greedy else None,
            top_p=sp.top_p if not sp.greedy else None,
            top_k=0 if not sp.greedy else None,
            max_new_tokens=sp.max_new_tokens,
            min_new_tokens=0,
            num_return_sequences=n_return,
            eos_token_id=list(sp.eos_token_ids) or None,
            pad_token_id=sp.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        model.train(was_training)
        tokens = out.sequences[:, ids.shape[1] :]
        logits = torch.stack(out.logits, dim=1)  # [N, T, V] raw (pre-processor) logits
        tokens = tokens[:, : logits.shape[1]]
        temp = 1.0 if sp.greedy else sp.temperature
        logprobs, entropy = token_logprobs_and_entropy(logits, tokens, temp, chunk_size=1024)
        del logits
        mask, truncated = completion_mask(tokens, sp.eos_token_ids)
        tokens = torch.where(mask.bool(), tokens, torch.full_like(tokens, sp.pad_token_id))
        index = torch.arange(len(prompts), device=tokens.device).repeat_interleave(sp.n) + offset
        return RolloutBatch(
            prompt_ids=[list(p) for p in prompts for _ in range(sp.n)],
            completion_ids=tokens.cpu(),
            completion_mask=mask.cpu(),
            logprobs=(logprobs * mask).cpu(),
            truncated=truncated.cpu(),
            prompt_index=index.cpu(),
            extras={"entropy": (entropy * mask).cpu()},
        )


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + size)) for lo in range(0, n, max(1, size))]


def _pad_right(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)


def _concat(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Join per-chunk batches, right-padding to the longest completion."""
    if len(parts) == 1:
        return parts[0]
    width = max(p.completion_ids.shape[1] for p in parts)
    return RolloutBatch(
        prompt_ids=[p for b in parts for p in b.prompt_ids],
        completion_ids=torch.cat([_pad_right(b.completion_ids, width, pad_id) for b in parts]),
        completion_mask=torch.cat([_pad_right(b.completion_mask, width, 0.0) for b in parts]),
        logprobs=torch.cat([_pad_right(b.logprobs, width, 0.0) for b in parts]),
        truncated=torch.cat([b.truncated for b in parts]),
        prompt_index=torch.cat([b.prompt_index for b in parts]),
        extras={"entropy": torch.cat([_pad_right(b.extras["entropy"], width, 0.0) for b in parts])},
    )
