"""The fast engine's sampling step on one GPU: device time per call of ``sample_tokens`` and of its
parts, at the LM-head width of Qwen2.5 (152,064), replayed as CUDA graphs.

    python benchmarks/sampling.py [--rows 1,64,128] [--logits normal|lm] [--chunks 1024,2048] [--json sampling.json]

Rows are batch sizes; columns: ``sample_tokens`` per mode (greedy, full, top_p=0.95: the Triton
kernel, ``sampling.sample_kernel``; ``sample_top_p_noskip``: its nucleus search without the
shortcut for chunks outside a level's interval; ``sample_top_p_c<N>``: chunks of N logits
instead of 4,096, from ``--chunks``), the same with the torch reference (``torch_*``,
:func:`sample_tokens_torch`), and parts of the torch top-p path (the sort on the bf16 logits,
softmax, the log-prob + entropy of :func:`qerl.rl.logprobs.token_logprobs_and_entropy`). Also
checks that the kernel's tokens match the reference's (``mismatch_*``: the share that differ,
float32 rounding at a CDF boundary). Prints a table, writes JSON.

Logits (synthetic, bf16): ``normal``, N(0, 2^2) for every token (a broad nucleus: about a third of
the vocabulary at top-p 0.95, as from a randomly initialised model); ``lm``, shaped like a trained
LM's: N(0, 2.5^2) for the vocabulary plus 32 tokens a row at N(14, 2^2), which hold almost all of
the mass (the nucleus a few dozen tokens, its edge far above the bulk).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from qerl.rl.logprobs import token_logprobs_and_entropy  # noqa: E402
from qerl.rollout.fast import sampling as S  # noqa: E402
from qerl.rollout.fast.sampling import sample_tokens_torch  # noqa: E402

VOCAB = 152064


def graph_us(fn, reps: int = 50) -> float:
    """Microseconds per replay of ``fn`` captured as a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def make_logits(b: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """``[b, VOCAB]`` bf16 logits of ``kind`` (see the module docstring)."""
    if kind == "normal":
        return (torch.randn(b, VOCAB, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    x = torch.randn(b, VOCAB, device="cuda", generator=gen) * 2.5
    top = torch.rand(b, VOCAB, device="cuda", generator=gen).topk(32, -1).indices  # 32 random ids
    x.scatter_(-1, top, 14 + 2 * torch.randn(b, 32, device="cuda", generator=gen))
    return x.to(torch.bfloat16)


def row(b: int, kind: str = "normal", chunks: tuple[int, ...] = ()) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(b)
    logits = make_logits(b, kind, gen)
    u = torch.rand(b, device="cuda", generator=gen)
    temp, top_p = torch.ones(1, device="cuda"), torch.full((1,), 0.95, device="cuda")
    tok = torch.zeros(b, 1, dtype=torch.long, device="cuda")
    modes = ("greedy", "full", "top_p")
    cells = {f"sample_{m}": graph_us(lambda m=m: S.sample_kernel(logits, u, temp, top_p, m)) for m in modes}
    cells["sample_top_p_noskip"] = graph_us(  # the search without its shortcut for outside chunks
        lambda: S.sample_kernel(logits, u, temp, top_p, "top_p", skip=False))
    for c in chunks:  # other chunk widths (fewer nucleus tokens a chunk: more chunks skip)
        cells[f"sample_top_p_c{c}"] = graph_us(lambda c=c: S.sample_kernel(logits, u, temp, top_p, "top_p", chunk=c))
    cells |= {f"torch_{m}": graph_us(lambda m=m: sample_tokens_torch(logits, u, temp, top_p, m))
              for m in modes}
    refs = {m: sample_tokens_torch(logits, u, temp, top_p, m)[0] for m in modes}
    for m in modes:
        got = S.sample_kernel(logits, u, temp, top_p, m)[0]
        cells[f"mismatch_{m}"] = float((got != refs[m]).float().mean())
    for c in chunks:
        got = S.sample_kernel(logits, u, temp, top_p, "top_p", chunk=c)[0]
        cells[f"mismatch_top_p_c{c}"] = float((got != refs["top_p"]).float().mean())
    cells["sort_bf16"] = graph_us(lambda: torch.sort(logits, stable=True, dim=-1, descending=True))
    cells["softmax"] = graph_us(lambda: torch.softmax(logits.float(), -1))
    cells["logprob_entropy"] = graph_us(
        lambda: token_logprobs_and_entropy(logits.float().unsqueeze(1), tok, 1.0, chunk_size=None))
    return {"B": b, "logits": kind, **cells}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64,128")
    ap.add_argument("--logits", default="normal", choices=("normal", "lm"))
    ap.add_argument("--chunks", default="", help="other chunk widths for top_p, e.g. 1024,2048")
    ap.add_argument("--json", default="sampling.json")
    a = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python benchmarks/sampling.py " + " ".join(sys.argv[1:]), "vocab": VOCAB,
           "unit": "us per call (CUDA graph replay)", "rows": []}
    for b in (int(x) for x in a.rows.split(",")):
        out["rows"].append(row(b, a.logits, tuple(int(c) for c in a.chunks.split(",") if c)))
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    keys = [k for k in out["rows"][0] if k not in ("B", "logits")]
    print("| B | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for r in out["rows"]:
        print(f"| {r['B']} | " + " | ".join(f"{r[k]:.3f}" if k.startswith("mismatch") else f"{r[k]:.0f}"
                                            for k in keys) + " |")


if __name__ == "__main__":
    main()
