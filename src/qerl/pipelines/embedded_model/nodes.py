"""The embedded default model: a tiny decoder with a local tokenizer, warm-started by supervised
training on the embedded task so that RL has both signal and room."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import pandas as pd

from qerl.eval.evaluate import correctness
from qerl.modeling.sft import (
    EmbeddedTask,
    SFTConfig,
    accuracy_stop,
    generate_completions,
    sft_train,
    split_entries,
)
from qerl.modeling.tiny import TinyModelSpec, build_model, build_tokenizer
from qerl.params import TinyModelParams

log = logging.getLogger(__name__)


def _task(p: TinyModelParams) -> EmbeddedTask:
    return EmbeddedTask(name=p.task.name, config=dict(p.task.config), scratchpad_fraction=p.task.scratchpad_fraction)


def build_sft_set(eval_prompts: pd.DataFrame, params: TinyModelParams) -> pd.DataFrame:
    """Supervised (prompt, completion) pairs of the task (``split == "sft"``) and a validation split
    (``split == "val"``) for early stopping; no question of either is in the held-out eval prompts."""
    task = _task(params)
    held_out = set(eval_prompts["question"])
    n_val = params.val_size
    pool = split_entries(task, {"all": params.sft_size + n_val + len(held_out)}, seed=params.sft_seed)["all"]
    rows = [e for e in pool if e["question"] not in held_out][: params.sft_size + n_val]
    sft_rows, val_rows = rows[: params.sft_size], rows[params.sft_size :]
    prompts, completions = task.sft_pairs(sft_rows, seed=params.sft_seed)
    sft = pd.DataFrame({"split": "sft", "prompt": prompts, "completion": completions, "answer": [str(e["answer"]) for e in sft_rows]})
    val = pd.DataFrame({"split": "val", "prompt": [task.prompt(e["question"]) for e in val_rows], "completion": "",
                        "answer": [str(e["answer"]) for e in val_rows]})
    return pd.concat([sft, val], ignore_index=True)


def train_embedded_model(sft_set: pd.DataFrame, params: TinyModelParams) -> tuple[dict[str, Any], pd.DataFrame]:
    """Tokenizer + model from scratch, then supervised warm start. Returns the model bundle and history."""
    t0 = time.perf_counter()
    sft, val = sft_set[sft_set["split"] == "sft"], sft_set[sft_set["split"] == "val"]
    corpus = (sft["prompt"] + sft["completion"]).head(2000).tolist()
    tokenizer = build_tokenizer(corpus, vocab_size=params.tokenizer_vocab_size)
    spec = TinyModelSpec(**params.spec)
    spec.validate()
    cfg = dataclasses.replace(SFTConfig(), **params.sft)
    model = build_model(spec, tokenizer, seed=cfg.seed)
    should_stop = None
    if len(val) and cfg.target_accuracy is not None:  # stop once the warm start reaches the target on validation
        should_stop, _ = accuracy_stop(model, tokenizer, val["prompt"].tolist(), val["answer"].tolist(), cfg.target_accuracy)
    model, history = sft_train(model, tokenizer, sft["prompt"].tolist(), sft["completion"].tolist(), cfg, should_stop=should_stop)
    seconds = time.perf_counter() - t0
    steps = int(history[-1]["step"]) if history else 0
    log.info("embedded model trained in %.1f s (%d SFT steps)", seconds, steps)
    hist = pd.DataFrame(history)
    hist["build_seconds_total"] = seconds
    return {"model": model.eval(), "tokenizer": tokenizer}, hist


def measure_embedded_accuracy(bundle: dict[str, Any], eval_prompts: pd.DataFrame, sft_history: pd.DataFrame, params: TinyModelParams) -> pd.DataFrame:
    """Greedy accuracy of the warm start on the held-out prompts, judged like RL evaluation."""
    comps = generate_completions(bundle["model"], bundle["tokenizer"], eval_prompts["prompt"].tolist(), params.eval_max_new_tokens)
    ok = correctness(eval_prompts, comps, dict(params.correctness), 1.0)
    acc = sum(ok) / max(1, len(ok))
    log.info("embedded model greedy accuracy on %d held-out prompts: %.3f", len(ok), acc)
    return pd.DataFrame(
        [{
            "task": params.task.name, "n_eval": len(ok), "greedy_accuracy": acc,
            "n_params": sum(p.numel() for p in bundle["model"].parameters()),
            "build_seconds": float(sft_history["build_seconds_total"].iloc[-1]),
        }]
    )
