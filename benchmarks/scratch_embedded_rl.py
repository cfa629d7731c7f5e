"""Feasibility experiment for the embedded default: tiny model -> SFT warm start -> GRPO with LoRA.

A self-contained scratch GRPO (no project RL code): LoRA (peft, r=16, every projection) on the SFT
model, G samples per prompt at temperature 1.0, rewards 2.0 x correct (reasoning-gym's verifier)
+ 0.2 x format, group-normalised advantages, token-level PPO-clip loss with one update per batch
(so the ratio is 1, clipping never binds: plain policy gradient). Greedy accuracy on held-out
prompts (disjoint by question from the SFT and RL prompts) is measured before and after RL, and
every ``--eval-every`` steps. ``--quant nvfp4|mxfp4`` freezes the base in 4-bit first
(``qerl.quant.linear.quantize_model_``), as the real pipeline does.

Why RL has signal here (see ``qerl.modeling.sft.EmbeddedTask``): the warm-start corpus answers
70% of the questions directly and shows a column-arithmetic scratchpad for 30%. After a short SFT
the model greedily prefers the direct style (the majority) although its scratchpad answers are
far more accurate; sampling at T=1 still tries the scratchpad in ~30% of the samples, GRPO
rewards it, and within a few dozen steps greedy decoding switches to the scratchpad on held-out
prompts. The "style" column of the log is the fraction of greedy completions with a non-empty
``<think>``.

Usage (CPU; ``--threads 1`` when the two cores are shared with other jobs, where 2 threads are
several times slower):
    .venv/bin/python benchmarks/scratch_embedded_rl.py --seeds 0 1 2 \
        --out data/08_reporting/scratch_embedded_rl.json [--quant nvfp4] [--sft-cache DIR]

Prints one table row per seed and writes a JSON report (settings, per-seed results and curves).
``--dump-entries`` / ``--entries-json`` let it run where reasoning-gym is not installed (integer
exact match then replaces the verifier; identical for this task's integer answers).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from qerl.modeling.sft import (  # noqa: E402
    EmbeddedTask,
    SFTConfig,
    embedded_warm_start,
    extract_answer,
    greedy_accuracy,
    split_entries,
)
from qerl.modeling.tiny import TinyModelSpec, load_tiny, save_tiny  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class RLSettings:
    steps: int = 150
    prompts_per_step: int = 16
    group_size: int = 8
    lr: float = 1e-3
    temperature: float = 1.0
    max_new_tokens: int = 32
    lora_r: int = 16
    lora_alpha: int = 32
    grad_clip: float = 1.0
    correct_reward: float = 2.0
    format_reward: float = 0.2
    eval_every: int = 25
    quant: str = "none"  # none | nvfp4 | mxfp4


def exact_int_score(answer: str | None, entry: dict) -> float:
    """Integer match (what chain_sum's verifier gives for integer answers), no reasoning-gym needed."""
    try:
        return float(answer is not None and int(answer.strip()) == int(entry["answer"]))
    except ValueError:
        return 0.0


def format_ok(text: str) -> bool:
    t = text.strip()
    return (
        t.startswith("<think>")
        and "</think>" in t
        and t.endswith("</answer>")
        and "<answer>" in t.split("</think>", 1)[1]
    )


def sample_group(model, tok, prompts, G, temperature, max_new_tokens, gen):
    """Left-padded sampling; returns prompt ids, completion ids [N,T], mask [N,T] (EOS included)."""
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        seq = model.generate(
            **enc,
            do_sample=True,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=G,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    comp = seq[:, enc["input_ids"].shape[1] :]
    eos = tok.eos_token_id
    is_eos = comp == eos
    # mask: tokens up to and including the first EOS
    after = (is_eos.cumsum(1) - is_eos.long()) > 0
    mask = (~after).float()
    p_ids = [
        [t for t, a in zip(row, am, strict=True) if a]
        for row, am in zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist(), strict=True)
    ]
    return p_ids, comp, mask


def policy_logprobs(model, p_ids, comp, mask, G, pad_id, temperature):
    """Log-probs [N, T] of the completion tokens under ``model`` (0 where ``mask`` is 0).

    Each row is re-packed as ``prompt + completion`` right-padded, so positions start at 0 exactly
    as in the left-padded generation (whose position ids come from the attention mask).
    """
    N, T = comp.shape
    lens = mask.sum(1).long().tolist()
    rows = [p_ids[i // G] + comp[i, : lens[i]].tolist() for i in range(N)]
    W = max(len(r) for r in rows)
    ids = torch.full((N, W), pad_id, dtype=torch.long)
    att = torch.zeros((N, W), dtype=torch.long)
    idx = torch.zeros((N, T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        att[i, : len(r)] = 1
        P = len(p_ids[i // G])
        idx[i, : lens[i]] = torch.arange(P - 1, P - 1 + lens[i])  # logits at P-1+j predict token j
    logits = model(input_ids=ids, attention_mask=att).logits.float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids.roll(-1, 1)[:, :, None]).squeeze(-1)
    return lp.gather(1, idx) * mask


def style_split(completions: list[str]) -> float:
    """Fraction of completions that use a non-empty think (the scratchpad style)."""
    return sum("<think></think>" not in c for c in completions) / max(1, len(completions))


def run_seed(
    seed: int,
    rl: RLSettings,
    sft: SFTConfig,
    spec: TinyModelSpec,
    task: EmbeddedTask,
    n_sft: int,
    n_rl: int,
    n_eval: int,
    data_seed: int,
    n_val: int = 200,
    log=print,
    cache_dir: str | None = None,
    entries_json: str | None = None,
    init_from: str | None = None,
    threads: int = 2,
) -> dict:
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    sizes = {"sft": n_sft, "val": n_val, "rl": n_rl, "eval": n_eval}
    if entries_json:  # pre-generated splits (for machines without reasoning-gym)
        with open(entries_json) as f:
            splits = json.load(f)
        splits = {k: splits[k][:n] for k, n in sizes.items()}
        score = exact_int_score
    else:
        splits = split_entries(task, sizes, seed=data_seed)
        score = task.scorer()
    sft_cfg = SFTConfig(**{**asdict(sft), "seed": seed, "num_threads": threads})
    key = hashlib.sha1(
        json.dumps(
            [task.to_dict(), spec.to_dict(), asdict(sft_cfg), n_sft, n_val, data_seed],
            sort_keys=True,
            default=str,
        ).encode()
    ).hexdigest()[:12]
    cached = os.path.join(cache_dir, key) if cache_dir else None
    val_curve: list = []
    if init_from:
        model, tok = load_tiny(init_from)
        hist, t_sft = [{"loss": float("nan"), "step": -1}], float("nan")
        log(f"[seed {seed}] SFT model from {init_from}")
    elif cached and os.path.exists(os.path.join(cached, "history.json")):
        model, tok = load_tiny(cached)
        with open(os.path.join(cached, "history.json")) as f:
            hist, t_sft, val_curve = json.load(f)
        log(f"[seed {seed}] SFT model from cache {cached}")
    else:
        ws = embedded_warm_start(
            task,
            spec,
            sft_cfg,
            data_seed=data_seed,
            splits=splits,
            scorer=score,
            max_new_tokens=rl.max_new_tokens,
        )
        model, tok, hist, val_curve = ws.model, ws.tokenizer, ws.history, ws.val_curve
        t_sft = time.perf_counter() - t0
        if cached:
            save_tiny(model, tok, cached)
            with open(os.path.join(cached, "history.json"), "w") as f:
                json.dump([hist, t_sft, val_curve], f)
    sft_steps = hist[-1]["step"]
    model.eval()
    EP = [task.prompt(e["question"]) for e in splits["eval"]]
    acc0, comps0 = greedy_accuracy(
        model, tok, EP, splits["eval"], max_new_tokens=rl.max_new_tokens, scorer=score
    )
    style0 = style_split(comps0)
    log(
        f"[seed {seed}] build+SFT {t_sft:.1f}s ({sft_steps} steps, val checks {val_curve}), "
        f"final loss {hist[-1]['loss']:.3f}, warm-start greedy acc {acc0:.3f} "
        f"(scratchpad style in {style0:.2f} of greedy completions)"
    )

    if rl.quant != "none":
        from qerl.quant.linear import quantize_model_  # type: ignore

        quantize_model_(model, rl.quant)
        accq, _ = greedy_accuracy(
            model, tok, EP, splits["eval"], max_new_tokens=rl.max_new_tokens, scorer=score
        )
        log(f"[seed {seed}] after {rl.quant} quantization greedy acc {accq:.3f}")
    else:
        accq = acc0

    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        model,
        LoraConfig(
            r=rl.lora_r,
            lora_alpha=rl.lora_alpha,
            lora_dropout=0.0,
            target_modules=LORA_TARGETS,
            bias="none",
        ),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=rl.lr, betas=(0.9, 0.99), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed + 1000)
    rl_entries = splits["rl"]
    curve = [{"step": 0, "greedy_acc": accq}]
    t_rl0 = time.perf_counter()
    t_gen = t_upd = t_eval = 0.0
    stats = []
    cursor = 0
    for step in range(rl.steps):
        batch = [rl_entries[(cursor + i) % len(rl_entries)] for i in range(rl.prompts_per_step)]
        cursor += rl.prompts_per_step
        prompts = [task.prompt(e["question"]) for e in batch]
        ta = time.perf_counter()
        model.eval()
        p_ids, comp, mask = sample_group(
            model, tok, prompts, rl.group_size, rl.temperature, rl.max_new_tokens, gen
        )
        texts = tok.batch_decode(comp, skip_special_tokens=True)
        G = rl.group_size
        rewards = torch.tensor(
            [
                rl.correct_reward * float(score(extract_answer(t), batch[i // G]) >= 1.0)
                + rl.format_reward * float(format_ok(t))
                for i, t in enumerate(texts)
            ]
        )
        correct = torch.tensor(
            [float(score(extract_answer(t), batch[i // G]) >= 1.0) for i, t in enumerate(texts)]
        )
        r = rewards.view(-1, G)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1)
        tb = time.perf_counter()
        t_gen += tb - ta
        model.train()
        lp = policy_logprobs(model, p_ids, comp, mask, G, tok.pad_token_id, rl.temperature)
        m = mask
        # token-level PPO-clip objective with old = current (one update per batch): ratio == 1
        ratio = torch.exp(lp - lp.detach())
        pg = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.28) * adv[:, None])
        loss = (pg * m).sum() / m.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = (
            torch.nn.utils.clip_grad_norm_(params, rl.grad_clip)
            if rl.grad_clip
            else torch.tensor(0.0)
        )
        opt.step()
        t_upd += time.perf_counter() - tb
        zero_std = float((r.std(1) == 0).float().mean())
        stats.append(
            {
                "step": step + 1,
                "reward": float(rewards.mean()),
                "sample_acc": float(correct.mean()),
                "zero_std_groups": zero_std,
                "grad_norm": float(gn),
                "len": float(m.sum(1).mean()),
            }
        )
        if rl.eval_every and ((step + 1) % rl.eval_every == 0 or step + 1 == rl.steps):
            te = time.perf_counter()
            acc, comps = greedy_accuracy(
                model, tok, EP, splits["eval"], max_new_tokens=rl.max_new_tokens, scorer=score
            )
            t_eval += time.perf_counter() - te
            curve.append(
                {"step": step + 1, "greedy_acc": acc, "greedy_scratch_style": style_split(comps)}
            )
            recent = stats[-rl.eval_every :]
            log(
                f"[seed {seed}] step {step + 1:4d} sample_acc {sum(s['sample_acc'] for s in recent) / len(recent):.3f} "
                f"greedy {acc:.3f} (style {style_split(comps):.2f}) zero-std {sum(s['zero_std_groups'] for s in recent) / len(recent):.2f} "
                f"rl_compute {t_gen + t_upd:.1f}s"
            )
    if curve[-1]["step"] != rl.steps:
        acc, _ = greedy_accuracy(
            model, tok, EP, splits["eval"], max_new_tokens=rl.max_new_tokens, scorer=score
        )
        curve.append({"step": rl.steps, "greedy_acc": acc})
    acc1 = curve[-1]["greedy_acc"]
    return {
        "seed": seed,
        "warm_start_acc": acc0,
        "warm_start_scratch_style": style0,
        "pre_rl_acc": accq,
        "post_rl_acc": acc1,
        "lift_points": 100 * (acc1 - accq),
        "sft_s": t_sft,
        "sft_steps": sft_steps,
        "sft_val_curve": val_curve,
        "sft_final_loss": hist[-1]["loss"],
        "rl_compute_s": t_gen + t_upd,
        "rl_generate_s": t_gen,
        "rl_update_s": t_upd,
        "eval_s": t_eval,
        "rl_wall_s": time.perf_counter() - t_rl0,
        "curve": curve,
        "stats_tail": stats[-5:],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--task", default=None, help="reasoning-gym name (default: EmbeddedTask's)")
    ap.add_argument("--task-config", default=None, help="JSON config for the task")
    ap.add_argument("--sft-steps", type=int, default=SFTConfig.steps)
    ap.add_argument("--sft-lr", type=float, default=SFTConfig.lr)
    ap.add_argument("--sft-batch", type=int, default=SFTConfig.batch_size)
    ap.add_argument("--n-sft", type=int, default=4000)
    ap.add_argument("--n-rl", type=int, default=4000)
    ap.add_argument("--n-eval", type=int, default=500)
    ap.add_argument("--n-val", type=int, default=200, help="validation prompts for SFT early stop")
    ap.add_argument(
        "--sft-target",
        type=float,
        default=SFTConfig.target_accuracy,
        help="stop SFT once val greedy accuracy reaches this (<0: fixed steps)",
    )
    ap.add_argument("--sft-min-steps", type=int, default=SFTConfig.min_steps)
    ap.add_argument("--sft-max-steps", type=int, default=SFTConfig.max_steps)
    ap.add_argument("--data-seed", type=int, default=1234)
    ap.add_argument("--scratch-frac", type=float, default=EmbeddedTask.scratchpad_fraction)
    ap.add_argument("--hidden", type=int, default=TinyModelSpec.hidden_size)
    ap.add_argument("--layers", type=int, default=TinyModelSpec.num_hidden_layers)
    ap.add_argument("--intermediate", type=int, default=TinyModelSpec.intermediate_size)
    for f, v in asdict(RLSettings()).items():
        ap.add_argument("--" + f.replace("_", "-"), type=type(v), default=v)
    ap.add_argument("--out", default=None, help="JSON report path")
    ap.add_argument(
        "--sft-cache", default=None, help="directory to cache SFT models in (reused by key)"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="torch threads (2 on an idle 2-core machine; 1 when the cores are shared)",
    )
    ap.add_argument(
        "--init-from", default=None, help="start RL from this saved SFT model (skip SFT)"
    )
    ap.add_argument("--entries-json", default=None, help="use pre-generated {sft,rl,eval} entries")
    ap.add_argument(
        "--dump-entries", default=None, help="write the {sft,rl,eval} entries here and exit"
    )
    a = ap.parse_args(argv)

    task = EmbeddedTask()
    if a.task:
        task = EmbeddedTask(name=a.task, config=json.loads(a.task_config or "{}"))
    elif a.task_config:
        task = EmbeddedTask(config=json.loads(a.task_config))
    task.scratchpad_fraction = a.scratch_frac
    spec = TinyModelSpec(
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        intermediate_size=a.intermediate,
        num_attention_heads=a.hidden // 32,
        num_key_value_heads=a.hidden // 32,
    )
    sft = SFTConfig(
        steps=a.sft_steps,
        max_steps=a.sft_max_steps,
        lr=a.sft_lr,
        batch_size=a.sft_batch,
        log_every=50,
        target_accuracy=None if a.sft_target < 0 else a.sft_target,
        min_steps=a.sft_min_steps,
    )
    rl = RLSettings(**{f: getattr(a, f) for f in asdict(RLSettings())})
    if a.dump_entries:
        sizes = {"sft": a.n_sft, "val": a.n_val, "rl": a.n_rl, "eval": a.n_eval}
        sp = split_entries(task, sizes, seed=a.data_seed)
        with open(a.dump_entries, "w") as f:
            json.dump(sp, f)
        return 0
    results = []
    for s in a.seeds:
        results.append(
            run_seed(
                s,
                rl,
                sft,
                spec,
                task,
                a.n_sft,
                a.n_rl,
                a.n_eval,
                a.data_seed,
                n_val=a.n_val,
                cache_dir=a.sft_cache,
                entries_json=a.entries_json,
                init_from=a.init_from,
                threads=a.threads,
            )
        )

    hdr = f"{'seed':>4} {'SFT s':>6} {'SFT n':>5} {'warm':>6} {'pre-RL':>6} {'post-RL':>7} {'lift pts':>8} {'RL s':>6} {'gen s':>6} {'upd s':>6}"
    print()
    print(
        f"task={task.name} {json.dumps(task.config)} model={spec.hidden_size}x{spec.num_hidden_layers} "
        f"SFT steps<={sft.max_steps} (stop at val acc {sft.target_accuracy} from {sft.min_steps}) lr={sft.lr} | RL steps={rl.steps} P={rl.prompts_per_step} G={rl.group_size} "
        f"lr={rl.lr} T={rl.temperature} max_new={rl.max_new_tokens} quant={rl.quant}"
    )
    print(hdr)
    for r in results:
        print(
            f"{r['seed']:>4} {r['sft_s']:6.1f} {r['sft_steps']:5d} {r['warm_start_acc']:6.3f} {r['pre_rl_acc']:6.3f} {r['post_rl_acc']:7.3f} "
            f"{r['lift_points']:8.1f} {r['rl_compute_s']:6.1f} {r['rl_generate_s']:6.1f} {r['rl_update_s']:6.1f}"
        )
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(
                {
                    "task": task.to_dict(),
                    "model": spec.to_dict(),
                    "sft": asdict(sft),
                    "rl": asdict(rl),
                    "n_sft": a.n_sft,
                    "n_rl": a.n_rl,
                    "n_eval": a.n_eval,
                    "results": results,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
