"""The embedded default model: a tiny decoder with a local tokenizer, warm-started by supervised
training on the selected embedded task (``embedded_model.task.preset``) until its validation
accuracy enters the band RL needs."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import pandas as pd

from qerl.embedded.presets import resolve_params, task_of
from qerl.embedded.sft import SFTConfig
from qerl.embedded.task import distinct_rows, split_rows
from qerl.embedded.warm_start import Band, greedy_accuracy, warm_start
from qerl.errors import QerlConfigError
from qerl.modeling.tiny import TinyModelSpec
from qerl.params import TinyModelParams

log = logging.getLogger(__name__)


def _build(cls: type, overrides: dict[str, Any], field: str) -> Any:
    """``cls(**overrides)``, an unknown key reported as a :class:`QerlConfigError` on ``field``."""
    names = [f.name for f in dataclasses.fields(cls)]
    bad = sorted(set(overrides) - set(names))
    if bad:
        raise QerlConfigError(f"{field}.{bad[0]}", f"not a field of {cls.__name__}", f"use only {names}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()})


def _generator_of(metadata: str) -> tuple[str, str]:
    gen = json.loads(metadata).get("reasoning_gym") or {}
    return str(gen.get("name")), json.dumps(gen.get("config", {}), sort_keys=True)


def build_sft_set(eval_prompts: pd.DataFrame, params: TinyModelParams, embedded_tasks: dict[str, Any]) -> pd.DataFrame:
    """Warm-start pairs (``split == "sft"``: prompt, completion) and a validation split
    (``split == "val"``: prompt-table rows, scored by the task's verifier); no question of either is
    in the held-out eval prompts, which must come from the same task (same generator and config)."""
    p = resolve_params(params, embedded_tasks)
    task = task_of(p)
    want = (task.name, json.dumps(dict(task.config), sort_keys=True))
    other = {_generator_of(m) for m in eval_prompts["metadata"]} - {want}
    if other:
        raise QerlConfigError(
            "data.sources",
            f"the held-out prompts come from {sorted(other)[0]}, not the embedded task {want}",
            "use the preset's prompts for data_prep (qerl.embedded.presets.data_params) or set "
            "data.sources to the same reasoning-gym name and config as embedded_model.task",
        )
    rows = distinct_rows(task, p.sft_size + p.val_size, p.sft_seed, exclude=eval_prompts["question"])
    parts = split_rows(rows, {"sft": p.sft_size, "val": p.val_size})
    prompts, completions = task.sft_pairs(parts["sft"], seed=p.sft_seed)
    sft = parts["sft"].assign(split="sft", prompt=prompts, completion=completions)
    val = parts["val"].assign(split="val", completion="")
    return pd.concat([sft, val], ignore_index=True)


def train_embedded_model(
    sft_set: pd.DataFrame, params: TinyModelParams, embedded_tasks: dict[str, Any]
) -> tuple[dict[str, Any], pd.DataFrame]:
    """Tokenizer + model from scratch, then SFT until validation accuracy enters the band. Outside
    the band it warns, or raises before the model is written (``band.on_miss: error``)."""
    p = resolve_params(params, embedded_tasks)
    spec = _build(TinyModelSpec, p.spec, "embedded_model.spec")
    sft_cfg = _build(SFTConfig, p.sft, "embedded_model.sft")
    band = _build(Band, p.band, "embedded_model.band")
    sft, val = sft_set[sft_set["split"] == "sft"], sft_set[sft_set["split"] == "val"]
    ws = warm_start(sft["prompt"].tolist(), sft["completion"].tolist(), val.reset_index(drop=True), spec, sft_cfg, band,
                    vocab_size=p.tokenizer_vocab_size, max_new_tokens=p.eval_max_new_tokens)
    log.info("embedded model (%s) trained in %.1f s (%d SFT steps, validation accuracy %s)",
             p.task.preset or p.task.name, ws.seconds, ws.steps, ws.val_accuracy)
    hist = pd.DataFrame(ws.history)
    hist["build_seconds_total"] = ws.seconds
    hist["val_accuracy"] = ws.val_accuracy
    hist["in_band"] = ws.in_band
    return {"model": ws.model, "tokenizer": ws.tokenizer}, hist


def measure_embedded_accuracy(
    bundle: dict[str, Any], eval_prompts: pd.DataFrame, sft_history: pd.DataFrame, params: TinyModelParams,
    embedded_tasks: dict[str, Any],
) -> pd.DataFrame:
    """Greedy accuracy of the warm start on the held-out prompts, judged like RL evaluation."""
    p = resolve_params(params, embedded_tasks)
    acc, _ = greedy_accuracy(bundle["model"], bundle["tokenizer"], eval_prompts, p.eval_max_new_tokens, dict(p.correctness))
    log.info("embedded model greedy accuracy on %d held-out prompts: %.3f", len(eval_prompts), acc)
    last = sft_history.iloc[-1]
    return pd.DataFrame(
        [{
            "preset": p.task.preset or "", "task": p.task.name, "config": json.dumps(p.task.config, sort_keys=True),
            "n_eval": len(eval_prompts), "greedy_accuracy": acc, "val_accuracy": last["val_accuracy"],
            "in_band": bool(last["in_band"]), "sft_steps": int(last["step"]),
            "n_params": sum(x.numel() for x in bundle["model"].parameters()),
            "build_seconds": float(last["build_seconds_total"]),
        }]
    )
