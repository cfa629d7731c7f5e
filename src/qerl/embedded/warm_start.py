"""The embedded warm start: local tokenizer + tiny model + SFT until validation accuracy enters the
band RL needs, with a clear warning (or error) when the budget runs out first.

Greedy validation uses the project's rollout engine (``qerl.rollout.get_engine("hf", device)``)
and correctness is the ``reasoning_gym`` reward reaching 1.0 (``qerl.eval.evaluate.correctness``),
so the warm start is judged exactly as RL's held-out evaluation judges the policy.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch

from qerl.embedded.sft import SFTConfig, sft_train
from qerl.errors import QerlConfigError
from qerl.modeling.tiny import TinyModelSpec, build_model, build_tokenizer

log = logging.getLogger(__name__)

CORRECTNESS: dict[str, Any] = {"name": "reasoning_gym"}
BAND_FIELD = "embedded_model.band"


class WarmStartBandWarning(UserWarning):
    """The warm start ended outside its accuracy band (RL will likely not lift it)."""


@dataclass(frozen=True)
class Band:
    """Validation greedy accuracy the warm start must end in, and what to do when it does not."""

    low: float = 0.15
    high: float = 0.70
    on_miss: str = "warn"  # "warn" | "error"

    def validate(self, field: str = BAND_FIELD) -> None:
        if not 0 <= self.low < self.high <= 1:
            raise QerlConfigError(field, f"low {self.low} / high {self.high} is not 0 <= low < high <= 1", "use e.g. low 0.15, high 0.7")
        if self.on_miss not in ("warn", "error"):
            raise QerlConfigError(f"{field}.on_miss", f"unknown value {self.on_miss!r}", "use warn or error")

    def contains(self, accuracy: float) -> bool:
        return self.low <= accuracy <= self.high


def as_policy(model, tokenizer):
    """Wrap a plain causal LM as a :class:`qerl.train.policy.Policy` (for the shared prompt
    encoding, generation and decoding helpers; no adapter, nothing quantized)."""
    from qerl.params import LoraParams, ModelParams, QuantParams
    from qerl.train.policy import Policy

    param = next(model.parameters())
    return Policy(model=model, tokenizer=tokenizer, model_settings=ModelParams(path=""), quant=QuantParams(format="none"),
                  lora=LoraParams(), device=param.device, dtype=param.dtype)


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, max_prompt_tokens: int = 512) -> list[str]:
    """Greedy completions (format tags kept, EOS / pad removed) from the project's hf engine."""
    from qerl.rollout import SamplingParams, get_engine
    from qerl.train.generate import decode_completions, encode_prompts

    policy = as_policy(model, tokenizer)
    ids, kept, _, _ = encode_prompts(policy, list(prompts), max_prompt_tokens, "truncate")
    sp = SamplingParams(n=1, greedy=True, max_new_tokens=max_new_tokens,
                        eos_token_ids=policy.eos_token_ids, pad_token_id=policy.pad_token_id)
    batch = get_engine("hf", policy.device).generate(model, ids, sp, None)
    lengths = batch.completion_lengths.tolist()
    return decode_completions(policy, [row[:n].tolist() for row, n in zip(batch.completion_ids, lengths, strict=True)])


def greedy_accuracy(
    model, tokenizer, rows: pd.DataFrame, max_new_tokens: int, reward: dict[str, Any] | None = None
) -> tuple[float, list[str]]:
    """Greedy accuracy on a prompt table (``prompt``, ``answer``, ``task``, ``metadata``): a
    completion is right when ``reward`` (default: the task's own verifier) reaches 1.0.
    Returns ``(accuracy, completions)``."""
    from qerl.eval.evaluate import correctness

    if rows.empty:
        return 0.0, []
    comps = greedy_completions(model, tokenizer, rows["prompt"].tolist(), max_new_tokens)
    ok = correctness(rows.reset_index(drop=True), comps, reward or CORRECTNESS, 1.0)
    return sum(ok) / len(ok), comps


def band_message(
    accuracy: float | None, band: Band, steps: int, seconds: float, sft: SFTConfig, spec: TinyModelSpec
) -> tuple[str, str]:
    """``(problem, fix)`` for a warm start outside its band: the measured accuracy, the band, the
    budget, and what to change (model size, budget, task difficulty)."""
    got = "was not measured (empty validation split)" if accuracy is None else f"is {accuracy:.1%}"
    budget = f"max_steps={sft.max_steps}" + (f", max_seconds={sft.max_seconds:g}" if sft.max_seconds else "")
    where = "below" if accuracy is not None and accuracy < band.low else "above"
    if accuracy is None:
        fix = "set embedded_model.val_size > 0"
    elif where == "below":
        fix = (f"give it more capacity (embedded_model.spec: hidden_size {spec.hidden_size} -> {spec.hidden_size + 64}, "
               f"num_hidden_layers {spec.num_hidden_layers} -> {spec.num_hidden_layers + 1}), a larger budget "
               f"(embedded_model.sft.max_steps / max_seconds, now {budget}) or an easier task "
               "(embedded_model.task.preset / task.config: fewer terms or digits)")
    else:
        fix = ("stop earlier (embedded_model.sft.target_accuracy, min_steps, check_every), a lower "
               "embedded_model.sft.lr, or a harder task (more terms or digits)")
    problem = (f"the warm start's validation greedy accuracy {got} after {steps} SFT steps ({seconds:.0f} s; "
               f"budget {budget}), outside the band {band.low:.0%}-{band.high:.0%} that RL needs "
               f"({where} it): RL will likely not lift it")
    return problem, fix


def check_band(accuracy: float | None, band: Band, steps: int, seconds: float, sft: SFTConfig, spec: TinyModelSpec) -> bool:
    """True when ``accuracy`` is inside ``band``; otherwise warn (``on_miss: warn``, returns False)
    or raise :class:`QerlConfigError` naming ``embedded_model.band`` (``on_miss: error``)."""
    if accuracy is not None and band.contains(accuracy):
        return True
    problem, fix = band_message(accuracy, band, steps, seconds, sft, spec)
    if band.on_miss == "error":
        raise QerlConfigError(BAND_FIELD, problem, fix + "; or set embedded_model.band.on_miss: warn to keep the model")
    msg = f"{BAND_FIELD}: {problem}. Fix: {fix}"
    log.warning(msg)
    warnings.warn(msg, WarmStartBandWarning, stacklevel=2)
    return False


@dataclass
class WarmStart:
    """What :func:`warm_start` built. ``val_curve``: ``(step, validation greedy accuracy)`` of the
    checks; ``val_accuracy``: the last one (None without a validation split); ``in_band``."""

    model: Any
    tokenizer: Any
    history: list[dict]
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0
    val_accuracy: float | None = None
    in_band: bool = False


def warm_start(
    prompts: Sequence[str],
    completions: Sequence[str],
    val: pd.DataFrame,
    spec: TinyModelSpec,
    sft: SFTConfig,
    band: Band,
    *,
    vocab_size: int = 384,
    tokenizer_corpus_size: int = 2000,
    max_new_tokens: int = 32,
) -> WarmStart:
    """Tokenizer (merges from the first ``tokenizer_corpus_size`` pairs), model (initialised with
    ``sft.seed``) and SFT, stopped once greedy accuracy on ``val`` reaches ``sft.target_accuracy``
    (or after ``sft.steps`` when it is None), then checked against ``band`` (:func:`check_band`:
    warns or raises before the caller writes anything)."""
    spec.validate()
    sft.validate()
    band.validate()
    if sft.target_accuracy is not None and not band.contains(sft.target_accuracy):
        raise QerlConfigError("embedded_model.sft.target_accuracy", f"{sft.target_accuracy} is outside the band {band.low}-{band.high}",
                              "pick a target inside embedded_model.band")
    t0 = time.perf_counter()
    n = tokenizer_corpus_size
    tok = build_tokenizer([p + c for p, c in zip(prompts[:n], completions[:n], strict=True)], vocab_size=vocab_size)
    model = build_model(spec, tok, seed=sft.seed)
    curve: list[tuple[int, float]] = []

    def should_stop(step: int) -> bool:
        acc, _ = greedy_accuracy(model, tok, val, max_new_tokens)
        curve.append((step, acc))
        log.info("warm start step %d: validation greedy accuracy %.3f", step, acc)
        return acc >= sft.target_accuracy

    stop = should_stop if (sft.target_accuracy is not None and not val.empty) else None
    model, history = sft_train(model, tok, list(prompts), list(completions), sft, should_stop=stop)
    steps = int(history[-1]["step"]) if history else 0
    if stop is None and not val.empty:
        curve.append((steps, greedy_accuracy(model, tok, val, max_new_tokens)[0]))
    acc = curve[-1][1] if curve else None
    seconds = time.perf_counter() - t0
    in_band = check_band(acc, band, steps, seconds, sft, spec)
    return WarmStart(model.eval(), tok, history, curve, steps, seconds, acc, in_band)
