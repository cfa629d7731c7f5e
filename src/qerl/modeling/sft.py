"""Supervised warm start of the embedded default model, and greedy evaluation.

The embedded default RL task (chosen by measurement, see ``benchmarks/scratch_embedded_rl.py``)
is described by :class:`EmbeddedTask`: reasoning-gym's ``chain_sum`` with two 2-digit terms
(``"State the final answer to the following arithmetic problem: 47 - 90 ="``), the prompt is the
raw question plus a newline, the completion is ``<think>...</think><answer>X</answer>`` + EOS.
The warm-start corpus mixes a direct answer (empty think, 70%) with a column-arithmetic
scratchpad (30%); a short SFT leaves a model that greedily answers directly (~30-40% correct on
held-out prompts) although its scratchpad is far more reliable, so GRPO at T=1 has a clear
signal and raises held-out greedy accuracy by 40-60 points within ~50-150 steps.

:func:`sft_train` trains any causal LM on (prompt, completion) pairs with the loss on completion
tokens only (EOS included), AdamW, a constant or cosine schedule and a step budget, optionally
stopped early by a check (deterministic given the seed, the model initialisation and the data).
:func:`embedded_warm_start` does the whole embedded build (splits, tokenizer, model, SFT stopped
once validation greedy accuracy reaches ``SFTConfig.target_accuracy``). :func:`greedy_accuracy`
runs batched left-padded greedy ``generate`` and scores the text inside ``<answer>...</answer>``.
"""

from __future__ import annotations

import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch

from qerl.modeling.tiny import ANSWER_CLOSE, ANSWER_OPEN, THINK_CLOSE, THINK_OPEN

# --------------------------------------------------------------------------------------------
# The embedded default task
# --------------------------------------------------------------------------------------------


def column_scratchpad(expression: str) -> str | None:
    """A short column-arithmetic scratchpad for ``"a + b"`` / ``"a - b"`` (non-negative ints).

    Least significant digit first, one step per column, carries / borrows written out::

        47 + 38  ->  7+8=15,4+3+1=8          (answer 85)
        52 - 38  ->  12-8=4,5-1-3=1          (answer 14)
        47 - 90  ->  90-47:10-7=3,9-1-4=4    (answer -43: the larger number goes first)

    Returns None for any other expression shape (the caller then leaves ``<think>`` empty).
    """
    m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(\d+)\s*", expression)
    if not m:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    prefix = ""
    if op == "-" and a < b:
        prefix = f"{b}-{a}:"
        a, b = b, a
    da, db = str(a)[::-1], str(b)[::-1]
    n = max(len(da), len(db))
    steps, carry = [], 0
    for i in range(n):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        if op == "+":
            r = x + y + carry
            steps.append(f"{x}+{y}" + (f"+{carry}" if carry else "") + f"={r}")
            carry = r // 10
        else:
            borrow_next = 1 if x - carry < y else 0
            top = x + 10 * borrow_next
            r = top - carry - y
            steps.append(f"{top}" + ("-1" if carry else "") + f"-{y}={r}")
            carry = borrow_next
    return prefix + ",".join(steps)


@dataclass
class EmbeddedTask:
    """The default procedural task: a reasoning-gym generator with a fixed config.

    Prompts are the raw question followed by ``prompt_suffix``; completions are
    ``<think>{think}</think><answer>{answer}</answer>`` (the EOS token is appended by the
    tokenizer-side code, it is not part of the text).

    The warm-start corpus mixes two completion styles: a direct answer (empty think) and, for a
    ``scratchpad_fraction`` of the examples, a short column-arithmetic scratchpad
    (:func:`column_scratchpad`) before the answer. A tiny model trained briefly on that mix prefers
    the direct style under greedy decoding (it is the majority) but is far more accurate with the
    scratchpad, which sampling at T=1 still explores: that is the signal RL turns into held-out
    greedy accuracy.
    """

    name: str = "chain_sum"
    config: dict = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}
    )
    prompt_suffix: str = "\n"
    scratchpad_fraction: float = 0.3

    def entries(self, seed: int, size: int) -> list[dict]:
        """``size`` reasoning-gym entries (question, answer, metadata) from generator ``seed``."""
        import reasoning_gym

        ds = reasoning_gym.create_dataset(self.name, seed=seed, size=size, **self.config)
        return [ds[i] for i in range(size)]

    def scorer(self) -> Callable[[str | None, dict], float]:
        """The task's own verifier: ``score(answer_text, entry) -> float in [0, 1]``."""
        import reasoning_gym

        ds = reasoning_gym.create_dataset(self.name, seed=0, size=1, **self.config)
        return ds.score_answer

    def prompt(self, question: str) -> str:
        return question + self.prompt_suffix

    @staticmethod
    def completion(answer: str, think: str = "") -> str:
        return f"{THINK_OPEN}{think}{THINK_CLOSE}{ANSWER_OPEN}{answer}{ANSWER_CLOSE}"

    @staticmethod
    def scratchpad(entry: dict) -> str | None:
        expr = (entry.get("metadata") or {}).get("expression")
        return column_scratchpad(expr) if isinstance(expr, str) else None

    def sft_pairs(self, entries: Sequence[dict], seed: int = 0) -> tuple[list[str], list[str]]:
        """(prompts, completions) of the warm-start corpus, the style of each drawn with ``seed``."""
        rng = random.Random(seed)
        prompts, comps = [], []
        for e in entries:
            think = ""
            if rng.random() < self.scratchpad_fraction:
                think = self.scratchpad(e) or ""
            prompts.append(self.prompt(e["question"]))
            comps.append(self.completion(str(e["answer"]), think))
        return prompts, comps

    def to_dict(self) -> dict:
        return asdict(self)


def split_entries(
    task: EmbeddedTask, sizes: dict[str, int], seed: int = 0, pool_factor: float = 1.5
) -> dict[str, list[dict]]:
    """Disjoint splits (no question shared between any two) drawn from one generator stream.

    ``sizes`` maps split name -> count (e.g. ``{"sft": 4000, "rl": 4000, "eval": 500}``).
    Duplicated questions are dropped, so splits are disjoint by question text.
    """
    need = sum(sizes.values())
    size = int(need * pool_factor) + 16
    while True:
        pool, seen = [], set()
        for e in task.entries(seed, size):
            if e["question"] not in seen:
                seen.add(e["question"])
                pool.append(e)
        if len(pool) >= need:
            break
        if size > need * 50:
            raise ValueError(
                f"task {task.name}: only {len(pool)} distinct questions, {need} requested"
            )
        size *= 2
    out, i = {}, 0
    for name, n in sizes.items():
        out[name] = pool[i : i + n]
        i += n
    return out


# --------------------------------------------------------------------------------------------
# Answer extraction
# --------------------------------------------------------------------------------------------

_ANSWER_RE = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)


def _local_extract_answer(text: str) -> str | None:
    m = _ANSWER_RE.findall(text)
    return m[-1].strip() if m else None


def extract_answer(text: str) -> str | None:
    """Text inside the last ``<answer>...</answer>`` (stripped), or None."""
    try:  # the project's shared helper, when present
        from qerl.rewards.base import extract_answer as _shared
    except ImportError:  # pragma: no cover - only while the rewards package is absent
        return _local_extract_answer(text)
    return _shared(text)


# --------------------------------------------------------------------------------------------
# SFT
# --------------------------------------------------------------------------------------------


@dataclass
class SFTConfig:
    """Warm-start recipe; the defaults are the embedded default's.

    Without a stop check :func:`sft_train` runs exactly ``steps`` steps. With one (a
    ``should_stop`` callable, e.g. from :func:`accuracy_stop`, as :func:`embedded_warm_start`
    builds from ``target_accuracy`` and a validation split) it checks every ``check_every`` steps
    from ``min_steps`` on and stops at the first check that passes, or after ``max_steps``. The
    early stop puts the warm start in a known accuracy band whatever the seed's learning curve
    (measured: a fixed 750 steps gave 14%-50% held-out greedy accuracy over 5 seeds; stopping at
    30% validation accuracy gave 31%-41%), and it stays deterministic given the seed. Use the
    ``constant`` schedule with early stopping (a cosine schedule would be cut short).
    """

    steps: int = 750
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    schedule: str = "constant"  # "constant" | "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 25
    num_threads: int | None = 2
    target_accuracy: float | None = 0.30
    min_steps: int = 600
    max_steps: int = 1500
    check_every: int = 50


def encode_pairs(tokenizer, prompts: Sequence[str], completions: Sequence[str]):
    """Token ids of each prompt and each completion (+ EOS), kept separate."""
    p_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return p_ids, [c + [eos] for c in c_ids]


def collate_right(p_ids, c_ids, pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 off the completion)."""
    seqs = [p + c for p, c in zip(p_ids, c_ids, strict=True)]
    T = max(len(s) for s in seqs)
    n = len(seqs)
    ids = torch.full((n, T), pad_id, dtype=torch.long)
    att = torch.zeros((n, T), dtype=torch.long)
    lab = torch.full((n, T), -100, dtype=torch.long)
    for i, (p, c) in enumerate(zip(p_ids, c_ids, strict=True)):
        L = len(p) + len(c)
        ids[i, :L] = torch.tensor(p + c)
        att[i, :L] = 1
        lab[i, len(p) : L] = torch.tensor(c)
    return ids, att, lab


def completion_loss(model, ids, att, lab) -> torch.Tensor:
    """Mean next-token cross-entropy over completion tokens."""
    logits = model(input_ids=ids, attention_mask=att).logits[:, :-1].float()
    tgt = lab[:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100
    )


def _lr_at(cfg: SFTConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    t = min(t, 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def sft_train(
    model,
    tokenizer,
    prompts: Sequence[str],
    completions: Sequence[str],
    cfg: SFTConfig | None = None,
    callback: Callable[[int, dict], None] | None = None,
    should_stop: Callable[[int], bool] | None = None,
):
    """Supervised training on (prompt, completion) pairs, loss on completion tokens only.

    Batches are drawn by a seeded permutation of the pairs (reshuffled each epoch). Without
    ``should_stop`` it runs ``cfg.steps`` steps. With it, ``should_stop(step)`` is called every
    ``cfg.check_every`` steps from ``cfg.min_steps`` on (under a forked RNG, so it cannot perturb
    training) and training ends at the first True or after ``cfg.max_steps`` steps. Returns
    ``(model, history)``; ``history`` holds one dict per logged step (``step``, ``loss``, ``lr``,
    ``elapsed_s``), the last step always included.
    """
    cfg = cfg or SFTConfig()
    if cfg.schedule not in ("cosine", "constant"):
        raise ValueError(f"SFTConfig.schedule must be 'cosine' or 'constant', got {cfg.schedule!r}")
    if len(prompts) != len(completions) or not prompts:
        raise ValueError("sft_train: prompts and completions must be non-empty and of equal length")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    p_ids, c_ids = encode_pairs(tokenizer, prompts, completions)
    pad = tokenizer.pad_token_id
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    model.train()
    order: list[int] = []
    history: list[dict] = []
    t0 = time.perf_counter()
    running = 0.0
    total = cfg.steps if should_stop is None else cfg.max_steps
    for step in range(total):
        if len(order) < cfg.batch_size:
            perm = list(range(len(p_ids)))
            rng.shuffle(perm)
            order.extend(perm)
        idx, order = order[: cfg.batch_size], order[cfg.batch_size :]
        ids, att, lab = collate_right([p_ids[i] for i in idx], [c_ids[i] for i in idx], pad)
        lr = _lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = completion_loss(model, ids, att, lab)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        running += loss.item()
        n_done = step + 1
        stop = False
        if should_stop is not None and n_done >= cfg.min_steps and n_done % cfg.check_every == 0:
            with torch.random.fork_rng(devices=[]):
                stop = bool(should_stop(n_done))
            model.train()
        last = stop or step == total - 1
        if n_done % cfg.log_every == 0 or last:
            k = n_done - (n_done - 1) // cfg.log_every * cfg.log_every
            rec = {
                "step": step + 1,
                "loss": running / k,
                "lr": lr,
                "elapsed_s": time.perf_counter() - t0,
            }
            history.append(rec)
            running = 0.0
            if callback:
                callback(step + 1, rec)
        if stop:
            break
    model.eval()
    return model, history


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def generate_completions(
    model,
    tokenizer,
    prompts: Sequence[str],
    max_new_tokens: int = 32,
    batch_size: int = 256,
    do_sample: bool = False,
    temperature: float = 1.0,
    num_return_sequences: int = 1,
) -> list[str]:
    """Batched left-padded ``generate``; returns decoded completions (special tokens dropped,
    format tags kept). With ``num_return_sequences = n`` row ``i*n + j`` is sample ``j`` of prompt
    ``i``."""
    was_training = model.training
    model.eval()
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    try:
        for s in range(0, len(prompts), batch_size):
            chunk = list(prompts[s : s + batch_size])
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            gen_kwargs = dict(
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
                num_return_sequences=num_return_sequences,
            )
            if do_sample:
                gen_kwargs.update(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
            else:
                gen_kwargs.update(do_sample=False)
            seq = model.generate(**enc, **gen_kwargs)
            new = seq[:, enc["input_ids"].shape[1] :]
            out.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = old_side
        if was_training:
            model.train()
    return out


def greedy_accuracy(
    model,
    tokenizer,
    prompts: Sequence[str],
    answers: Sequence[str] | Sequence[dict],
    max_new_tokens: int = 32,
    batch_size: int = 256,
    scorer: Callable[[str | None, dict], float] | None = None,
) -> tuple[float, list[str]]:
    """Greedy accuracy on ``prompts``.

    ``answers`` are gold answer strings (exact match after ``strip()``) or reasoning-gym entries
    (dicts), scored by ``scorer(extracted_answer, entry)`` (a score of 1.0 counts as correct).
    Returns ``(accuracy, completions)``.
    """
    if len(prompts) != len(answers):
        raise ValueError("greedy_accuracy: prompts and answers differ in length")
    comps = generate_completions(model, tokenizer, prompts, max_new_tokens, batch_size)
    return score_completions(comps, answers, scorer), comps


def score_completions(
    completions: Sequence[str],
    answers: Sequence[str] | Sequence[dict],
    scorer: Callable[[str | None, dict], float] | None = None,
) -> float:
    """Fraction of completions whose extracted answer is correct (see :func:`greedy_accuracy`)."""
    if not completions:
        return 0.0
    ok = 0
    for c, a in zip(completions, answers, strict=True):
        pred = extract_answer(c)
        if isinstance(a, dict):
            if scorer is None:
                ok += int(pred is not None and pred == str(a["answer"]).strip())
            else:
                ok += int(scorer(pred, a) >= 1.0)
        else:
            ok += int(pred is not None and pred == str(a).strip())
    return ok / len(completions)


# --------------------------------------------------------------------------------------------
# One call: the embedded default's warm start
# --------------------------------------------------------------------------------------------


def accuracy_stop(
    model,
    tokenizer,
    prompts: Sequence[str],
    answers: Sequence[str] | Sequence[dict],
    target: float,
    scorer: Callable[[str | None, dict], float] | None = None,
    max_new_tokens: int = 32,
    batch_size: int = 256,
) -> tuple[Callable[[int], bool], list[tuple[int, float]]]:
    """A ``should_stop`` for :func:`sft_train`: True once greedy accuracy on ``prompts`` (a
    validation split, never the held-out evaluation prompts) reaches ``target``. Also returns the
    list it appends ``(step, accuracy)`` to at each check."""
    curve: list[tuple[int, float]] = []

    def should_stop(step: int) -> bool:
        acc, _ = greedy_accuracy(
            model, tokenizer, prompts, answers, max_new_tokens, batch_size, scorer=scorer
        )
        curve.append((step, acc))
        return acc >= target

    return should_stop, curve


@dataclass
class WarmStart:
    """What :func:`embedded_warm_start` built. ``val_curve``: ``(step, greedy accuracy)`` of the
    early-stopping checks; ``steps``: SFT steps actually run."""

    model: object
    tokenizer: object
    splits: dict[str, list[dict]]
    history: list[dict]
    val_curve: list[tuple[int, float]]
    steps: int
    seconds: float


DEFAULT_SIZES = {"sft": 4000, "val": 200, "rl": 4000, "eval": 500}


def embedded_warm_start(
    task: EmbeddedTask | None = None,
    spec=None,
    sft: SFTConfig | None = None,
    sizes: dict[str, int] | None = None,
    data_seed: int = 1234,
    seed: int | None = None,
    tokenizer_corpus_size: int = 2000,
    splits: dict[str, list[dict]] | None = None,
    scorer: Callable[[str | None, dict], float] | None = None,
    max_new_tokens: int = 32,
) -> WarmStart:
    """Build the embedded default end to end.

    Disjoint task splits (``sizes``, default :data:`DEFAULT_SIZES`; or pass ``splits`` and
    ``scorer`` directly), the local tokenizer (merges learned from the first
    ``tokenizer_corpus_size`` SFT pairs), the tiny model (initialised with ``seed``, default
    ``sft.seed``) and its SFT warm start, stopped early on the ``"val"`` split when
    ``sft.target_accuracy`` is set (the split must then exist).
    """
    from qerl.modeling.tiny import TinyModelSpec, build_model, build_tokenizer

    t0 = time.perf_counter()
    task = task or EmbeddedTask()
    spec = spec or TinyModelSpec()
    sft = sft or SFTConfig()
    if seed is not None and seed != sft.seed:
        sft = SFTConfig(**{**asdict(sft), "seed": seed})
    if splits is None:
        splits = split_entries(task, sizes or DEFAULT_SIZES, seed=data_seed)
    prompts, comps = task.sft_pairs(splits["sft"], seed=data_seed)
    n = tokenizer_corpus_size
    tok = build_tokenizer([p + c for p, c in zip(prompts[:n], comps[:n], strict=True)])
    model = build_model(spec, tok, seed=sft.seed)

    val_curve: list[tuple[int, float]] = []
    should_stop = None
    if sft.target_accuracy is not None:
        if not splits.get("val"):
            raise ValueError("embedded_warm_start: target_accuracy needs a non-empty 'val' split")
        val = splits["val"]
        should_stop, val_curve = accuracy_stop(
            model,
            tok,
            [task.prompt(e["question"]) for e in val],
            val,
            sft.target_accuracy,
            scorer=scorer or task.scorer(),
            max_new_tokens=max_new_tokens,
        )

    model, history = sft_train(model, tok, prompts, comps, sft, should_stop=should_stop)
    steps = history[-1]["step"] if history else 0
    return WarmStart(model, tok, splits, history, val_curve, steps, time.perf_counter() - t0)
