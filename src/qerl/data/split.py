"""The deterministic, task-stratified train / eval split of a prompt table."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import pandas as pd

from qerl.data.schema import COL_ID, COL_TASK
from qerl.errors import QerlConfigError


def _split_key(seed: int, row_id: str) -> int:
    """Deterministic pseudo-random sort key of a row for a given seed."""
    digest = hashlib.blake2b(f"{seed}\x00{row_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _allocate(counts: Mapping[str, int], total: int) -> dict[str, int]:
    """Split ``total`` over groups proportionally to ``counts`` (largest remainder, stable)."""
    n = sum(counts.values())
    if n == 0 or total == 0:
        return {k: 0 for k in counts}
    exact = {k: total * c / n for k, c in counts.items()}
    quota = {k: math.floor(v) for k, v in exact.items()}
    rest = total - sum(quota.values())
    for k in sorted(counts, key=lambda k: (-(exact[k] - quota[k]), k))[:rest]:
        quota[k] += 1
    return quota


def _resolve_eval_size(
    n: int, eval_fraction: float | None, eval_size: int | None, prefix: str
) -> int:
    """Number of eval rows for a pool of ``n`` rows."""
    if eval_size is not None:
        n_eval = eval_size
        fld, what = f"{prefix}.eval_size", f"eval_size={eval_size}"
    else:
        frac = 0.1 if eval_fraction is None else eval_fraction
        n_eval = max(1, round(frac * n)) if frac > 0 and n > 1 else 0
        fld, what = f"{prefix}.eval_fraction", f"eval_fraction={frac}"
    if n_eval >= n > 0:
        raise QerlConfigError(
            fld,
            f"{what} leaves no training prompts out of {n}",
            "lower it or add more data (or mark a source with use: eval)",
        )
    return n_eval


def split_train_eval(
    df: pd.DataFrame,
    *,
    eval_fraction: float | None = None,
    eval_size: int | None = None,
    seed: int = 0,
    prefix: str = "data",
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Deterministic train / eval split, stratified by ``task``.

    Each row gets a key hashed from ``(seed, id)``; per task, the rows with the smallest keys go
    to eval, in numbers proportional to the task's share of ``eval_size`` (or ``eval_fraction`` of
    the rows, default 0.1). The same seed always gives the same split (independent of row order),
    a different seed a different one. Both outputs are ordered by key (a seeded shuffle).
    """
    keyed = df.assign(_key=[_split_key(seed, i) for i in df[COL_ID].tolist()])
    keyed = keyed.sort_values(["_key", COL_ID], kind="stable")
    n_eval = _resolve_eval_size(len(keyed), eval_fraction, eval_size, prefix)
    counts = keyed.groupby(COL_TASK, sort=True).size().to_dict()
    quota = _allocate({str(k): int(v) for k, v in counts.items()}, n_eval)
    rank = keyed.groupby(COL_TASK, sort=False).cumcount()
    is_eval = [r < quota[t] for r, t in zip(rank.tolist(), keyed[COL_TASK].tolist(), strict=True)]
    mask = pd.Series(is_eval, index=keyed.index)
    train = keyed[~mask].drop(columns="_key").reset_index(drop=True)
    evals = keyed[mask].drop(columns="_key").reset_index(drop=True)
    return train, evals
