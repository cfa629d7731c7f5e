"""Supervised training of a causal LM on (prompt, completion) pairs, loss on completion tokens only.

AdamW, the project's learning-rate schedule (``qerl.train.state.build_scheduler``: linear warm-up,
then constant or cosine to 0), a step budget and an optional stop check, deterministic given the
seed, the model initialisation and the data.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from qerl.errors import QerlConfigError
from qerl.train.state import build_scheduler


@dataclass(frozen=True)
class SFTConfig:
    """Warm-start recipe; the defaults are the embedded default's.

    Without a stop check :func:`sft_train` runs exactly ``steps`` steps. With one it checks every
    ``check_every`` steps from ``min_steps`` on and stops at the first check that passes, or after
    ``max_steps`` steps or ``max_seconds`` of training (whichever comes first). ``target_accuracy``
    is the validation accuracy the warm start stops at (used by :mod:`qerl.embedded.warm_start`;
    ``None``: no early stop, run ``steps``). Use the ``constant`` schedule with early stopping
    (a cosine schedule would be cut short).
    """

    steps: int = 750
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    schedule: str = "constant"  # "constant" | "cosine"
    warmup_steps: int = 20
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 25
    num_threads: int | None = None
    target_accuracy: float | None = 0.30
    min_steps: int = 600
    max_steps: int = 1500
    max_seconds: float | None = None
    check_every: int = 50

    def validate(self, field: str = "embedded_model.sft") -> None:
        """Raise :class:`QerlConfigError` for a schedule, budget or target that cannot work."""
        if self.schedule not in ("constant", "cosine"):
            raise QerlConfigError(f"{field}.schedule", f"unknown schedule {self.schedule!r}", "use constant or cosine")
        for name in ("steps", "batch_size", "max_steps", "check_every", "log_every"):
            if getattr(self, name) < 1:
                raise QerlConfigError(f"{field}.{name}", f"must be >= 1, got {getattr(self, name)}", "use a positive integer")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise QerlConfigError(
                f"{field}.target_accuracy", f"{self.target_accuracy} is not in (0, 1]", "use e.g. 0.3, or null for no early stop"
            )
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise QerlConfigError(f"{field}.max_seconds", f"must be > 0, got {self.max_seconds}", "use e.g. 240, or null")


def encode_pairs(tokenizer, prompts: Sequence[str], completions: Sequence[str]) -> tuple[list, list]:
    """Token ids of each prompt and each completion (+ EOS), kept separate."""
    p_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return p_ids, [c + [eos] for c in c_ids]


def collate_right(p_ids, c_ids, pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 off the completion)."""
    seqs = [p + c for p, c in zip(p_ids, c_ids, strict=True)]
    width, n = max(len(s) for s in seqs), len(seqs)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    att = torch.zeros((n, width), dtype=torch.long)
    lab = torch.full((n, width), -100, dtype=torch.long)
    for i, (p, c) in enumerate(zip(p_ids, c_ids, strict=True)):
        end = len(p) + len(c)
        ids[i, :end] = torch.tensor(p + c)
        att[i, :end] = 1
        lab[i, len(p) : end] = torch.tensor(c)
    return ids, att, lab


def completion_loss(model, ids: torch.Tensor, att: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over completion tokens."""
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    tgt = lab[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)


def sft_train(
    model,
    tokenizer,
    prompts: Sequence[str],
    completions: Sequence[str],
    cfg: SFTConfig | None = None,
    callback: Callable[[int, dict], None] | None = None,
    should_stop: Callable[[int], bool] | None = None,
):
    """Supervised training; returns ``(model, history)``.

    Batches are drawn by a seeded permutation of the pairs (reshuffled each epoch). Without
    ``should_stop`` it runs ``cfg.steps`` steps. With it, ``should_stop(step)`` is called every
    ``cfg.check_every`` steps from ``cfg.min_steps`` on (under a forked RNG, so it cannot perturb
    training) and training ends at the first True, after ``cfg.max_steps`` steps or once
    ``cfg.max_seconds`` have passed (checked at the same points, and a last check is made there).
    ``history`` holds one dict per logged step (``step``, ``loss``, ``lr``, ``elapsed_s``), the
    last step always included.
    """
    cfg = cfg or SFTConfig()
    cfg.validate()
    if len(prompts) != len(completions) or not prompts:
        raise ValueError("sft_train: prompts and completions must be non-empty and of equal length")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    p_ids, c_ids = encode_pairs(tokenizer, prompts, completions)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    total = cfg.steps if should_stop is None else cfg.max_steps
    sched = build_scheduler(opt, total, cfg.warmup_steps / total, cfg.schedule)
    model.train()
    order: list[int] = []
    history: list[dict] = []
    t0, running = time.perf_counter(), 0.0
    for step in range(total):
        if len(order) < cfg.batch_size:
            perm = list(range(len(p_ids)))
            rng.shuffle(perm)
            order.extend(perm)
        idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
        ids, att, lab = collate_right([p_ids[i] for i in idx], [c_ids[i] for i in idx], tokenizer.pad_token_id)
        lr = sched.get_last_lr()[0]
        loss = completion_loss(model, ids, att, lab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        sched.step()
        running += loss.item()
        n_done = step + 1
        stop = False
        if should_stop is not None:
            out_of_time = cfg.max_seconds is not None and time.perf_counter() - t0 >= cfg.max_seconds
            due = n_done >= cfg.min_steps and n_done % cfg.check_every == 0
            if due or out_of_time or n_done == total:
                with torch.random.fork_rng(devices=[]):
                    stop = bool(should_stop(n_done)) or out_of_time
                model.train()
        last = stop or n_done == total
        if n_done % cfg.log_every == 0 or last:
            k = n_done - (n_done - 1) // cfg.log_every * cfg.log_every
            rec = {"step": n_done, "loss": running / k, "lr": lr, "elapsed_s": time.perf_counter() - t0}
            history.append(rec)
            running = 0.0
            if callback:
                callback(n_done, rec)
        if stop:
            break
    model.eval()
    return model, history
