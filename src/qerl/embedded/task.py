"""An embedded task: a reasoning-gym generator + config, its prompt template and warm-start style.

Prompts are rendered with the project's prompt templates (``qerl.data.templates``) and entries are
drawn with the project's reasoning-gym loader (``qerl.data.sources.load_reasoning_gym``), so the
warm start sees exactly the prompts and metadata RL will see, and its validation is scored by the
same verifier (the ``reasoning_gym`` reward). Completions are
``<think>{trace}</think><answer>{answer}</answer>`` (the EOS token is appended by the SFT code):
a ``trace_fraction`` of the warm-start answers show the task's trace (:mod:`qerl.embedded.traces`),
the rest leave ``<think>`` empty. A tiny model trained briefly on that mix prefers the direct style
under greedy decoding (the majority) but is more accurate with the trace, which sampling at T=1
still explores: the signal RL turns into held-out greedy accuracy.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from qerl.embedded.traces import get_trace
from qerl.modeling.tiny import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN


def _default_config() -> dict[str, Any]:
    return {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}


@dataclass(frozen=True)
class EmbeddedTask:
    """A reasoning-gym generator with a fixed config and its warm-start completion style.

    Attributes:
        name: reasoning-gym dataset name.
        config: its config (e.g. ``min_terms``, ``max_digits``).
        template: prompt template (``qerl.data.templates``: a name or a string with ``{question}``);
            must equal ``data.template`` of the RL prompts.
        trace: trace style (a name in :data:`qerl.embedded.traces.TRACES`).
        trace_fraction: share of warm-start answers that show the trace.
    """

    name: str = "chain_sum"
    config: Mapping[str, Any] = field(default_factory=_default_config)
    template: str = "{question}\n"
    trace: str = "column"
    trace_fraction: float = 0.3

    def __post_init__(self) -> None:
        get_trace(self.trace)  # fail on an unknown style before any work

    def source(self, size: int, seed: int) -> dict[str, Any]:
        """A ``data.sources`` entry for this task (what ``data_prep`` should load)."""
        return {"kind": "reasoning_gym", "name": self.name, "size": size, "seed": seed, "config": dict(self.config)}

    def prompt_table(self, size: int, seed: int) -> pd.DataFrame:
        """``size`` entries of generator ``seed`` as a prompt table (``qerl.data.schema``)."""
        from qerl.data.sources import load_reasoning_gym
        from qerl.data.templates import get_template

        tmpl = get_template(self.template, "", field="embedded_model.task.template")
        return load_reasoning_gym(self.source(size, seed), tmpl, field_name="embedded_model.task")

    def completion(self, answer: str, think: str = "") -> str:
        """The completion text (no EOS)."""
        return f"{THINK_OPEN}{think}{THINK_CLOSE}{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"

    def trace_of(self, entry: Mapping[str, Any]) -> str | None:
        """The trace of one reasoning-gym entry (None where the style has none for it)."""
        return get_trace(self.trace)(entry)

    def sft_pairs(self, rows: pd.DataFrame, seed: int = 0) -> tuple[list[str], list[str]]:
        """(prompts, completions) of the warm-start corpus; each row's style drawn with ``seed``."""
        rng = random.Random(seed)
        comps = []
        for entry, answer in zip(entries(rows), rows["answer"].astype(str), strict=True):
            think = ""
            if rng.random() < self.trace_fraction:
                think = self.trace_of(entry) or ""
            comps.append(self.completion(answer, think))
        return rows["prompt"].tolist(), comps


def entries(rows: pd.DataFrame) -> list[dict[str, Any]]:
    """The reasoning-gym entries stored in a prompt table's ``metadata`` column."""
    return [(json.loads(m) if isinstance(m, str) else m)["entry"] for m in rows["metadata"]]


def distinct_rows(
    task: EmbeddedTask, n: int, seed: int, exclude: Iterable[str] = (), pool_factor: float = 1.5
) -> pd.DataFrame:
    """The first ``n`` rows of generator ``seed`` whose questions are distinct and not in
    ``exclude`` (e.g. the held-out evaluation questions). The generator size starts at
    ``(n + len(exclude)) * pool_factor`` and doubles until enough distinct questions come out.

    Raises:
        QerlConfigError: the task has fewer distinct questions than asked for.
    """
    from qerl.errors import QerlConfigError

    held_out = set(exclude)
    need = n + len(held_out)
    size = int(need * pool_factor) + 16
    while True:
        table = task.prompt_table(size, seed)
        keep = ~table["question"].duplicated() & ~table["question"].isin(held_out)
        rows = table[keep]
        if len(rows) >= n:
            return rows.head(n).reset_index(drop=True)
        if size > need * 50:
            raise QerlConfigError(
                "embedded_model.sft_size",
                f"task {task.name} {dict(task.config)} has only {len(rows)} distinct questions "
                f"outside the held-out set, {n} requested",
                "lower sft_size / val_size or widen the task config (more terms or digits)",
            )
        size *= 2


def split_rows(rows: pd.DataFrame, sizes: Mapping[str, int]) -> dict[str, pd.DataFrame]:
    """Consecutive, disjoint slices of ``rows`` (``{"sft": 4000, "val": 200}``)."""
    out, i = {}, 0
    for name, k in sizes.items():
        out[name] = rows.iloc[i : i + k].reset_index(drop=True)
        i += k
    return out

