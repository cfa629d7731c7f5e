"""reasoning-gym sources: procedural tasks generated on the fly, re-scorable by their verifier."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from qerl.data.rows import default_id_prefix, render_rows, to_json
from qerl.data.schema import (
    COL_ANSWER,
    COL_ID,
    COL_METADATA,
    COL_QUESTION,
    COL_SOURCE,
    COL_TASK,
    SOURCE_REASONING_GYM,
)
from qerl.data.specs import ReasoningGymSource, parse_source
from qerl.data.templates import PromptTemplate


def load_reasoning_gym(
    spec: ReasoningGymSource | Mapping[str, Any],
    template: PromptTemplate | None = None,
    *,
    field_name: str = "data.sources[0]",
) -> pd.DataFrame:
    """Generate ``size`` entries of a reasoning-gym task as a prompt table.

    ``answer`` is the entry's answer as text (``""`` when the task has no single answer);
    ``metadata`` holds ``{"entry": {question, answer, metadata}, "reasoning_gym": {name, config,
    seed, size, index}}`` so :func:`qerl.rewards.builtin.score_reasoning_gym` can re-score it.
    """
    raw = {"kind": SOURCE_REASONING_GYM, **spec} if isinstance(spec, Mapping) else spec
    parsed = parse_source(raw, field_name)
    assert isinstance(parsed, ReasoningGymSource)
    import reasoning_gym

    ds = reasoning_gym.create_dataset(
        parsed.name, size=parsed.size, seed=parsed.seed, **dict(parsed.config)
    )
    prefix = default_id_prefix(parsed)
    gen = {
        "name": parsed.name,
        "config": dict(parsed.config),
        "seed": parsed.seed,
        "size": parsed.size,
    }
    rows = []
    for i in range(parsed.size):
        entry = ds[i]
        answer = entry.get("answer")
        full = {
            "question": entry["question"],
            "answer": answer,
            "metadata": entry.get("metadata", {}),
        }
        rows.append(
            {
                COL_ID: f"{prefix}:{i}",
                COL_QUESTION: str(entry["question"]),
                COL_ANSWER: "" if answer is None else str(answer),
                COL_TASK: parsed.name,
                COL_SOURCE: SOURCE_REASONING_GYM,
                COL_METADATA: to_json({"entry": full, "reasoning_gym": {**gen, "index": i}}),
            }
        )
    return render_rows(pd.DataFrame(rows), template)
