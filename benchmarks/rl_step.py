"""Full GRPO steps at real scale on one GPU: rollout -> score -> update through the project's own
stage functions (``qerl.train.generate.sample_rollouts``, ``qerl.train.score.score_step``,
``qerl.train.update.update_step``), on random-init Qwen2.5 architectures with their real
vocabulary, built layer by layer on the GPU in the cell's format (no full bf16 copy anywhere).

Workload (the paper's shape): P prompts x G samples, prompt 256 random tokens, completions of a
fixed length (EOS masked off), LoRA r=32 (alpha 64) on every linear layer, gradient checkpointing,
AQN sigma 1e-2 during rollouts, recomputed old log-probs + token-truncated IS (the defaults).
Per cell: rollout s, update s, step s, completion tokens/s, the update's ratio to its FLOP floor
(4 passes x 2 x params x tokens / the measured bf16 matmul rate), peak GiB, or OOM. The first step
of a cell warms up (graph capture, kernel compilation); the last step is reported.

    python benchmarks/rl_step.py --cells 7b/none,7b/nvfp4 --json rl_step.json
    python benchmarks/rl_step.py --cells 72b/nvfp4 --prompts 2 --steps 1 --memory-budget 80

Data parallel (docs/distributed.md): under ``torchrun`` each rank generates its shard of the
``--prompts`` and the update all-reduces the LoRA gradients, as in training; rank 0 prints and
writes the JSON (``steps_per_s`` is the slowest rank's)::

    torchrun --standalone --nproc_per_node=2 benchmarks/rl_step.py --cells 7b/nvfp4 --json rl_step_2gpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pandas as pd
import torch

from qerl.modeling.lora import apply_lora
from qerl.modeling.random_init import build_random_policy_base, qwen25_config
from qerl.params import LoraParams, ModelParams, QuantParams, RewardParams, RLParams, RolloutParams
from qerl.rewards.base import register_reward
from qerl.rollout import get_engine
from qerl.train import distributed as dist
from qerl.train.checkpoints import RunDir
from qerl.train.generate import sample_rollouts
from qerl.train.policy import Policy
from qerl.train.score import score_step
from qerl.train.state import TrainState, build_optimizer, build_scheduler
from qerl.train.update import update_step

ARCH = {"tiny": "tiny", "0.5b": "qwen2.5-0.5b", "1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b", "14b": "qwen2.5-14b",
        "32b": "qwen2.5-32b", "72b": "qwen2.5-72b"}


@register_reward("bench_random")
def _random_reward(seed: int = 0):
    """A random reward in [0, 2] per completion (a random model scores 0 on any real task)."""
    gen = torch.Generator().manual_seed(seed)

    def fn(prompts, completions, **columns):
        return (torch.rand(len(completions), generator=gen) * 2).tolist()

    return fn


class _Tokens:
    """The few tokenizer attributes the rollouts table needs (the prompts are token ids already)."""

    eos_token = pad_token = None
    eos_token_id = pad_token_id = 0

    def batch_decode(self, ids, skip_special_tokens=False):
        return ["" for _ in ids]


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else float("nan")


def _config(arch: str):
    """The architecture's config; ``tiny`` is a 2-layer Qwen2 for a CPU check of this script."""
    if arch == "tiny":
        from transformers import Qwen2Config

        return Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return qwen25_config(arch)


def matmul_tflops() -> float:
    """The measured bf16 matmul rate (fp4_matmul.matmul_rate on CUDA; a float32 512^3 on CPU)."""
    if DEVICE.type == "cuda":
        sys.path.insert(0, os.path.dirname(__file__))
        from fp4_matmul import matmul_rate

        return matmul_rate() / 1e12
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    return 10 * 2 * 512**3 / (time.perf_counter() - t) / 1e12


def build(arch: str, fmt: str) -> Policy:
    dt = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    base = build_random_policy_base(_config(ARCH[arch]), fmt, device=DEVICE, dtype=dt, seed=0)
    lora = LoraParams(preset="paper")
    model = apply_lora(base, lora, gradient_checkpointing=True, seed=0).eval()
    dev = torch.device("cuda", torch.cuda.current_device()) if DEVICE.type == "cuda" else DEVICE
    return Policy(model, _Tokens(), ModelParams(path=ARCH[arch], device=DEVICE.type), QuantParams(format=fmt), lora,
                  dev, dt, True)


def linear_params(policy: Policy) -> tuple[int, int]:
    """(decoder linear weights, LM-head weights) -- what the FLOP floor counts."""
    cfg = _config(policy.model_settings.path)
    h, i, L, heads, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = h // heads
    per_layer = h * (heads * hd) + 2 * h * (kv * hd) + (heads * hd) * h + 3 * h * i
    return L * per_layer, cfg.vocab_size * h


def one_step(policy: Policy, step: int, args, rl: RLParams, rollout: RolloutParams, state: TrainState) -> dict:
    vocab = policy.model.config.vocab_size
    g = torch.Generator().manual_seed(step)
    lo, hi = dist.shard(args.prompts)  # this rank's prompts (all of them in one process)
    ids = torch.randint(1, vocab, (args.prompts, args.prompt_len), generator=g).tolist()[lo:hi]
    prompts = pd.DataFrame({"id": [f"p{k}" for k in range(lo, hi)], "prompt": [""] * (hi - lo),
                            "answer": "0", "task": "random", "metadata": "{}"})
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync()
    # the trainer's own sampling stage, with fixed-length completions (no EOS)
    table = sample_rollouts(policy, prompts, ids, step, args.sigma, rollout, 0, rows=list(range(lo, hi)),
                            eos_token_ids=())
    # what stays allocated once the engine has released its KV cache (weights + prepared 4-bit tensors)
    alloc_rollout = torch.cuda.memory_allocated() / 2**30 if DEVICE.type == "cuda" else float("nan")
    table.insert(0, "run", "bench/rl_step")
    scored = score_step(table, RewardParams(functions=[{"name": "bench_random", "kwargs": {"seed": step}}]), rl)
    peak_rollout = _peak_gib()
    row = update_step(policy, state, scored, rl, rollout)
    _sync()
    row["peak_rollout_gib"] = peak_rollout
    row["alloc_after_rollout_gib"] = alloc_rollout
    row["peak_gib"] = _peak_gib()
    return row


def run_cell(arch: str, fmt: str, args, rate: float, tmp: Path) -> dict:
    cell = {"model": arch, "format": fmt, "prompts": args.prompts, "group": args.group, "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens}
    policy = None
    try:
        t = time.perf_counter()
        policy = build(arch, fmt)
        cell["build_s"] = time.perf_counter() - t
        cell["single_copy"] = args.single_copy
        cell["weights_gib"] = torch.cuda.memory_allocated() / 2**30 if DEVICE.type == "cuda" else float("nan")
        rl = RLParams(lr=1e-5, max_grad_norm=0.2, gradient_checkpointing=True, micro_batch_tokens="auto",
                      memory_budget_gib=args.memory_budget, optimizer="adamw")
        rollout = RolloutParams(engine=args.engine, group_size=args.group, max_new_tokens=args.new_tokens,
                                max_prompt_tokens=args.prompt_len, kv_budget_gib=args.kv_budget,
                                single_weight_copy=args.single_copy)
        opt = build_optimizer(policy.lora_parameters(), "adamw", rl.lr, 0.0)
        state = TrainState(run=RunDir(tmp, "bench", f"{arch}-{fmt}"), total_steps=args.steps, save_every=10**9,
                           optimizer=opt, scheduler=build_scheduler(opt, args.steps, 0.0, "constant"))
        for step in range(1, args.steps + 1):
            row = one_step(policy, step, args, rl, rollout, state)
        dec, head = linear_params(policy)
        rows = args.prompts * args.group
        tokens_all, tokens_comp = rows * (args.prompt_len + args.new_tokens), rows * args.new_tokens
        floor = 4 * 2 * (dec * tokens_all + head * tokens_comp) / (rate * 1e12 * dist.world_size())  # per GPU
        cell.update({
            "rollout_s": row["time/generate"], "update_s": row["time/update"],
            "step_s": row["time/generate"] + row["time/score"] + row["time/update"],
            "tokens_per_s": tokens_comp / (row["time/generate"] + row["time/score"] + row["time/update"]),
            "steps_per_s": 1.0 / (row["time/generate"] + row["time/score"] + row["time/update"]),
            "world_size": dist.world_size(),
            "rollout_tokens_per_s": row["rollout/tokens_per_s"], "update_floor_s": floor,
            "update_x_floor": row["time/update"] / floor, "peak_gib": row["peak_gib"],
            "peak_rollout_gib": row["peak_rollout_gib"],
            "alloc_after_rollout_gib": row["alloc_after_rollout_gib"], "micro_batches": row.get("train/micro_batches"),
            "mismatch_kl": row.get("mismatch/kl"), "logprob_gap_mean": row.get("mismatch/logprob_gap_mean"),
            "is_weight_mean": row.get("mismatch/is_weight_mean"), "is_clipped_frac": row.get("mismatch/is_clipped_frac"),
            "loss": row.get("train/loss"), "steps_run": args.steps,
        })
    except torch.OutOfMemoryError as err:
        where = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in traceback.extract_tb(err.__traceback__)]
        cell.update({"oom": True, "error": str(err).splitlines()[0][:200], "where": where[-6:]})
    finally:
        get_engine.cache_clear()  # its plan holds the cell's model
        del policy
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", default="7b/none,7b/nvfp4", help="model/format pairs, e.g. 7b/none,32b/nvfp4")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--sigma", type=float, default=1e-2)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--memory-budget", type=float, default=None, help="GiB: sizes the update's micro-batches")
    ap.add_argument("--kv-budget", type=float, default=None, help="GiB: rollout KV cache per wave")
    ap.add_argument("--single-copy", action="store_true",
                    help="rollout.single_weight_copy: the 4-bit weights once on the GPU")
    ap.add_argument("--json", default="rl_step.json")
    args = ap.parse_args()
    dist.init_from_env()  # under torchrun: one rank a GPU
    rate = matmul_tflops()
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name() if DEVICE.type == "cuda"
           else "cpu", "bf16_tflops": rate,
           "args": vars(args), "cells": []}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.cells.split(","):
            arch, fmt = spec.split("/")
            cell = run_cell(arch, fmt, args, rate, Path(tmp))
            out["cells"].append(cell)
            if dist.is_main():
                Path(args.json).write_text(json.dumps(out, indent=1))
                print(json.dumps(cell), flush=True)  # noqa: T201
    if not dist.is_main():
        return
    cols = ["model", "format", "world_size", "rollout_s", "update_s", "step_s", "steps_per_s", "tokens_per_s",
            "update_x_floor", "peak_gib"]
    print(" | ".join(cols))  # noqa: T201
    for c in out["cells"]:
        print(" | ".join("OOM" if c.get("oom") and k not in ("model", "format") else
                         (f"{c[k]:.2f}" if isinstance(c.get(k), float) and math.isfinite(c[k]) else str(c.get(k, "")))
                         for k in cols))  # noqa: T201


if __name__ == "__main__":
    main()
