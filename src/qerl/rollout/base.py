"""The rollout interface: what every generation engine takes and returns.

An engine samples ``n`` completions for each prompt from a causal LM (the quantized base with its
live, unmerged LoRA adapter and whatever AQN noise is currently applied to its norm weights) and
returns the sampled tokens with the log-probabilities the *sampling* policy gave them.

Log-prob convention (shared with the trainer, so the rollout-vs-trainer gap is meaningful):
``logprob[t] = log_softmax(logits[t] / temperature)[token[t]]`` -- temperature applied, top-p
*not* renormalised (the same convention as TRL and verl); greedy decoding uses ``T = 1``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``n`` is the group size G (samples per prompt)."""

    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    greedy: bool = False

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(
                f"SamplingParams.temperature must be > 0 when sampling, got {self.temperature}; "
                "set greedy=True for argmax decoding"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class RolloutBatch:
    """Sampled completions, ``N = len(prompts) * n`` rows, row ``i`` belongs to prompt ``i // n``.

    Attributes:
        prompt_ids: token ids of each row's prompt (unpadded), length N.
        completion_ids: [N, T] completion tokens, right-padded with ``pad_token_id``.
        completion_mask: [N, T] 1.0 for generated tokens (EOS included), 0.0 for padding.
        logprobs: [N, T] sampling-policy log-probs of the chosen tokens (0 where masked).
        truncated: [N] True where no EOS was produced within ``max_new_tokens``.
        prompt_index: [N] index of the row's prompt in the input list.
    """

    prompt_ids: list[list[int]]
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    truncated: torch.Tensor
    prompt_index: torch.Tensor
    extras: dict = field(default_factory=dict)

    @property
    def completion_lengths(self) -> torch.Tensor:
        return self.completion_mask.sum(dim=1).long()

    def __len__(self) -> int:
        return self.completion_ids.shape[0]


@runtime_checkable
class RolloutEngine(Protocol):
    """Anything that turns prompts into a :class:`RolloutBatch`."""

    name: str

    def generate(
        self,
        model: torch.nn.Module,
        prompt_ids: list[list[int]],
        sampling: SamplingParams,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
    ) -> RolloutBatch:
        """Sample ``sampling.n`` completions per prompt with ``model`` in eval mode, no grad.

        ``generator``: one for the whole batch, or one per prompt (then a prompt's samples depend on
        its own generator alone, not on the other prompts of the batch: what lets data-parallel ranks
        sample their shards exactly as one process samples the whole batch)."""
        ...
