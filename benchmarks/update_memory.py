"""Activation memory of the update's forward + backward per token (the number the micro-batch
planner, ``qerl.train.update.micro_batch_tokens``, estimates), measured on a random-init Qwen2.5
with the real vocabulary: peak minus resident memory for R rows of prompt + completion tokens,
through ``completion_logprobs`` (checkpointed decoder layers, chunked LM head) and a backward pass,
with gradient checkpointing on and off.

    python benchmarks/update_memory.py --model 7b --format nvfp4 --rows 2,4 --json update_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rl_step import DEVICE, build  # noqa: E402

from qerl.params import RLParams  # noqa: E402
from qerl.train.update import completion_logprobs, make_batch, micro_batch_tokens  # noqa: E402

CUDA = DEVICE.type == "cuda"


def _alloc() -> int:
    if CUDA:
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return 0


def probe(policy, rows: int, prompt: int, completion: int, checkpointing: bool) -> dict:
    model = policy.model
    base = model.get_base_model()
    if not checkpointing:  # the policy is built with it on, as apply_lora sets it (probed first)
        base.gradient_checkpointing_disable()
    model.train()
    vocab = base.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, vocab, (rows, prompt), generator=g).tolist()
    comps = torch.randint(1, vocab, (rows, completion), generator=g).tolist()
    batch = make_batch(prompts, comps, 0, policy.device)
    resident = _alloc()
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    try:
        logp, ent = completion_logprobs(model, batch, 1.0, 1024)
        (logp.sum() + 0 * ent.sum()).backward()
        _alloc()
    except torch.OutOfMemoryError:
        return {"rows": rows, "checkpointing": checkpointing, "oom": True}
    tokens = rows * (prompt + completion)
    extra = torch.cuda.max_memory_allocated() - resident if CUDA else float("nan")
    model.zero_grad(set_to_none=True)
    return {"rows": rows, "checkpointing": checkpointing, "tokens": tokens, "seconds": time.perf_counter() - t,
            "extra_gib": extra / 2**30, "bytes_per_token": extra / tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="7b")
    ap.add_argument("--format", default="nvfp4")
    ap.add_argument("--rows", default="2,4")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--json", default="update_memory.json")
    args = ap.parse_args()
    policy = build(args.model, args.format)
    attn = getattr(policy.model.get_base_model().config, "_attn_implementation", None)
    est = micro_batch_tokens(policy, RLParams(gradient_checkpointing=True, micro_batch_tokens="auto",
                                              memory_budget_gib=None)) if DEVICE.type == "cuda" else None
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": args.model, "format": args.format,
           "attn_implementation": attn, "planner_tokens_for_free_memory": est, "probes": []}
    for ckpt in (True, False):
        for r in [int(x) for x in args.rows.split(",")][: (None if ckpt else 1)]:
            res = probe(policy, r, args.prompt_len, args.new_tokens, ckpt)
            out["probes"].append(res)
            print(json.dumps(res), flush=True)  # noqa: T201
            Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
