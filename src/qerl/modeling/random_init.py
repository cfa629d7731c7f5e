"""Random-initialised models of real architectures (no download) and a synthetic GSM8K-format file,
to run the GPU recipe end to end where no real weights can be fetched.

    python -m qerl.modeling.random_init --arch qwen2.5-1.5b --out data/06_models/random_qwen2.5-1.5b \
        --gsm8k data/01_raw/gsm8k_synthetic.jsonl

The model keeps the architecture's real hidden sizes, layer and head counts; its vocabulary is the
project's small byte-level tokenizer (rounded up to 64 rows), since a random model needs no more.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

#: Qwen2.5 shapes: hidden, intermediate, layers, attention heads, kv heads.
QWEN25 = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8),
}


def qwen25_config(arch: str, vocab_size: int, pad_id: int, eos_id: int, max_positions: int = 4096):
    """A transformers ``Qwen2Config`` with the real shape of ``arch``."""
    from transformers import Qwen2Config

    hidden, inter, layers, heads, kv = QWEN25[arch]
    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_positions,
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=arch in ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b"),
        pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None,
    )


def make_random_model(arch: str, out: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write a random-init ``arch`` model + the local tokenizer to ``out`` (safetensors)."""
    from transformers import AutoModelForCausalLM

    from qerl.modeling.tiny import VOCAB_MULTIPLE, build_tokenizer, round_up

    tok = build_tokenizer(None)
    vocab = round_up(len(tok), VOCAB_MULTIPLE)
    cfg = qwen25_config(arch, vocab, tok.pad_token_id, tok.eos_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def write_synthetic_gsm8k(path: str | Path, n: int, seed: int = 0) -> Path:
    """``n`` one-step word problems in GSM8K's JSONL format (``answer`` ends in ``#### <number>``)."""
    rng = random.Random(seed)
    names = ["Ava", "Ben", "Chen", "Dana", "Eli", "Farah", "Gus", "Hana"]
    items = ["apples", "books", "coins", "pencils", "stickers", "marbles"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for _ in range(n):
            who, what = rng.choice(names), rng.choice(items)
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            q = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?"
            f.write(json.dumps({"question": q, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=sorted(QWEN25), default="qwen2.5-0.5b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gsm8k", help="also write a synthetic GSM8K-format JSONL file here")
    ap.add_argument("--gsm8k-size", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(make_random_model(args.arch, args.out, args.seed))  # noqa: T201
    if args.gsm8k:
        print(write_synthetic_gsm8k(args.gsm8k, args.gsm8k_size, args.seed))  # noqa: T201


if __name__ == "__main__":
    main()
