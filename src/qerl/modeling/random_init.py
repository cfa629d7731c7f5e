"""Random-initialised models of real architectures (no download), built and quantized layer by
layer, and a synthetic GSM8K-format file, to measure and run the GPU recipe where no real weights
can be fetched.

:func:`build_random_policy_base` is what benchmarks use: a Hugging Face causal LM of a real
architecture (e.g. ``qwen25_config("qwen2.5-72b")``, real 152k vocabulary) with no full-precision
copy anywhere. The skeleton is built on the meta device; then, module by module in model order,
each Linear weight is drawn on ``device`` (normal, std = the config's ``initializer_range``),
quantized at once into ``fmt`` and released, so at most one full-precision Linear weight exists
at any time. Embeddings, norms and skipped Linears (``lm_head``) are materialised in ``dtype``
(norm weights 1, biases 0, the padding row 0: the initialisation transformers gives these
models). Every tensor is drawn from its own generator, seeded from ``(seed, parameter name)``:
the same seed gives the same bits on a device, whatever the format, so an ``nvfp4`` model is
bit-identical to quantizing the ``none`` model of the same seed.

The command line writes a small-vocabulary model to disk for the GPU preset smoke run:

    python -m qerl.modeling.random_init --arch qwen2.5-1.5b --out data/06_models/random_qwen2.5-1.5b \
        --gsm8k data/01_raw/gsm8k_synthetic.jsonl

That model keeps the architecture's real hidden sizes, layer and head counts; its vocabulary is
the project's small byte-level tokenizer (rounded up to 64 rows), since a random model needs no more.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from qerl.modeling.bnb import (
    BNB_FORMATS,
    bnb_linear4bit,
    keep_bnb_weights_trainable,
    require_bitsandbytes,
)
from qerl.modeling.devices import resolve_device
from qerl.modeling.loader import check_quant_format
from qerl.modeling.skeleton import build_skeleton, embedding_names, finish, ties_embeddings
from qerl.quant.formats import FP4_FORMATS
from qerl.quant.linear import QuantLinear, module_matches, plan_quantization, set_submodule

__all__ = [
    "QWEN25",
    "build_random_policy_base",
    "make_random_model",
    "qwen25_config",
    "write_synthetic_gsm8k",
]

#: Qwen2.5 base models: hidden, intermediate, layers, attention heads, kv heads, vocabulary,
#: tied embeddings, RMSNorm eps (from the models' config.json files).
QWEN25: dict[str, tuple[int, int, int, int, int, int, bool, float]] = {
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True, 1e-6),
    "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151936, True, 1e-6),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, 151936, True, 1e-6),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False, 1e-6),
    "qwen2.5-14b": (5120, 13824, 48, 40, 8, 152064, False, 1e-5),
    "qwen2.5-32b": (5120, 27648, 64, 40, 8, 152064, False, 1e-5),
    "qwen2.5-72b": (8192, 29568, 80, 64, 8, 152064, False, 1e-6),
}


def qwen25_config(
    arch: str,
    vocab_size: int | None = None,
    pad_id: int | None = None,
    eos_id: int | None = 151643,
    max_positions: int = 32768,
) -> Any:
    """A transformers ``Qwen2Config`` with the real shape of ``arch`` (a key of :data:`QWEN25`).

    ``vocab_size`` defaults to the real vocabulary (151936 / 152064); ``max_positions`` only
    bounds positions (the rotary tables are computed per call), 32768 by default.
    """
    from transformers import Qwen2Config

    if arch not in QWEN25:
        raise ValueError(f"unknown architecture {arch!r}; presets: {sorted(QWEN25)}")
    hidden, inter, layers, heads, kv, vocab, tie, eps = QWEN25[arch]
    return Qwen2Config(
        vocab_size=vocab_size or vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        rms_norm_eps=eps,
        tie_word_embeddings=tie,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
    )


def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded from ``(seed, name)`` (independent of build order)."""
    digest = hashlib.blake2b(f"{seed}\x00{name}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "big") >> 1)


def _init_value(module: nn.Module, attr: str, like: torch.Tensor, name: str, std: float,
                seed: int, device: torch.device) -> torch.Tensor:  # fmt: skip
    """The initial value of parameter ``attr`` of ``module`` (transformers' default init rule)."""
    out = torch.empty(like.shape, dtype=like.dtype, device=device)
    kind = type(module).__name__
    if "Norm" in kind:
        return out.fill_(1.0 if attr == "weight" else 0.0)
    if attr == "bias":
        return out.zero_()
    out.normal_(0.0, std, generator=_generator(seed, name, device))
    padding = getattr(module, "padding_idx", None) if isinstance(module, nn.Embedding) else None
    if padding is not None:
        out[padding].zero_()
    return out


def _quant_targets(
    model: nn.Module,
    fmt: str,
    skip_modules: tuple[str, ...],
    on_indivisible: Literal["skip", "error"],
) -> set[str]:
    """Names of the Linear layers to quantize (the loader's plan for FP4, every non-skipped
    ``nn.Linear`` for bitsandbytes, none for ``none``)."""
    if fmt in FP4_FORMATS:
        return set(plan_quantization(model, fmt, skip_modules, on_indivisible).quantized)
    if fmt in BNB_FORMATS:
        return {
            n
            for n, m in model.named_modules()
            if type(m) is nn.Linear and not module_matches(n, skip_modules)
        }
    return set()


def build_random_policy_base(
    config: Any,
    fmt: str = "nvfp4",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    skip_modules: Iterable[str] = ("lm_head",),
    *,
    on_indivisible: Literal["skip", "error"] = "skip",
    bnb_double_quant: bool = True,
) -> Any:
    """A random-init causal LM built on ``device`` and quantized to ``fmt`` one Linear at a time.

    Args:
        config: a transformers config, or a preset name of :data:`QWEN25` (real vocabulary).
        fmt: ``none``, ``nvfp4`` / ``mxfp4`` (:class:`~qerl.quant.linear.QuantLinear`, the
            per-layer quantization of :func:`~qerl.quant.linear.quantize_model_`) or ``nf4`` /
            ``fp4`` (bitsandbytes ``Linear4bit``, as a ``BitsAndBytesConfig`` load makes them).
        device: where the model is built (the full-precision weights never leave it).
        dtype: dtype of everything that is not quantized (and of bitsandbytes' matmuls).
        seed: the same seed gives the same bits (on one device), whatever ``fmt``.
        skip_modules: Linear modules kept in ``dtype`` (dotted-name patterns).
        on_indivisible: nvfp4/mxfp4 layers whose ``in_features`` is not a multiple of the block
            size: kept in ``dtype`` with a warning (``skip``) or refused (``error``).
        bnb_double_quant: bitsandbytes' nested quantization of the block scales.

    Returns:
        The model in eval mode, ready for :func:`qerl.modeling.lora.apply_lora`.

    Raises:
        QerlConfigError: unknown format or device, bitsandbytes missing for nf4/fp4, an
            indivisible layer with ``on_indivisible="error"`` -- before anything is allocated.
    """
    cfg = qwen25_config(config) if isinstance(config, str) else copy.deepcopy(config)
    check_quant_format(fmt)
    dev = resolve_device(device)
    if fmt in BNB_FORMATS:
        require_bitsandbytes(fmt)
    std = float(getattr(cfg, "initializer_range", 0.02) or 0.02)
    model = build_skeleton(cfg, dtype)
    targets = _quant_targets(model, fmt, tuple(skip_modules), on_indivisible)
    tie = ties_embeddings(cfg)
    in_name, out_name = embedding_names(model)
    for name, module in list(model.named_modules()):
        if name in targets:
            _materialize_quantized(model, name, module, fmt, dev, dtype, seed, std, bnb_double_quant,
                                   tied_from=in_name if tie and name == out_name else None)  # fmt: skip
            continue
        for attr, param in list(module._parameters.items()):
            if (
                param is None
                or not param.is_meta
                or (tie and name == out_name and attr == "weight")
            ):
                continue
            full = f"{name}.{attr}" if name else attr
            value = _init_value(module, attr, param, full, std, seed, dev)
            module._parameters[attr] = nn.Parameter(value, requires_grad=param.requires_grad)
    finish(model, cfg, dev, field="config")
    if fmt in BNB_FORMATS:
        keep_bnb_weights_trainable(model)
        model.is_loaded_in_4bit = True  # as transformers marks a bitsandbytes load
    return model.eval()


def _materialize_quantized(model: nn.Module, name: str, linear: nn.Module, fmt: str,
                           device: torch.device, dtype: torch.dtype, seed: int, std: float,
                           double_quant: bool, tied_from: str | None) -> None:  # fmt: skip
    """Draw the Linear at ``name`` on ``device``, quantize it in place and drop the float weight.

    ``tied_from`` names the input embedding when a tied output embedding is quantized (the
    quantized copy is made from the embedding, as the loader does).
    """
    assert isinstance(linear, nn.Linear)
    if tied_from is not None:
        weight = model.get_submodule(tied_from).weight
    else:
        weight = _init_value(linear, "weight", linear.weight, f"{name}.weight", std, seed, device)
    bias = (
        None
        if linear.bias is None
        else torch.zeros(linear.out_features, dtype=dtype, device=device)
    )
    if fmt in FP4_FORMATS:
        layer: nn.Module = QuantLinear.from_weight(weight, bias, fmt, device=device)
    else:
        layer = bnb_linear4bit(
            weight, bias, fmt, compute_dtype=dtype, double_quant=double_quant, device=device
        )
    set_submodule(model, name, layer)
    del weight


def make_random_model(
    arch: str,
    out: str | Path,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    real_vocab: bool = False,
) -> Path:
    """Write a random-init ``arch`` model with the project's small tokenizer to ``out``.

    ``real_vocab``: the architecture's real vocabulary size (152k for Qwen2.5: the LM head and
    the logits cost what they cost in a real run; ids past the small tokenizer decode to nothing)
    instead of the tokenizer's own size."""
    from qerl.modeling.tiny import VOCAB_MULTIPLE, build_tokenizer, round_up

    tok = build_tokenizer(None)
    vocab = QWEN25[arch][5] if real_vocab else round_up(len(tok), VOCAB_MULTIPLE)
    cfg = qwen25_config(arch, vocab, tok.pad_token_id, tok.eos_token_id, max_positions=4096)
    model = build_random_policy_base(cfg, "none", device, dtype, seed)
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
            f.write(
                json.dumps({"question": q, "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
            )
    return path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--arch", choices=sorted(QWEN25), default="qwen2.5-0.5b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--gsm8k", help="also write a synthetic GSM8K-format JSONL file here")
    ap.add_argument("--gsm8k-size", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--real-vocab", action="store_true",
                    help="the architecture's real vocabulary size, not the small tokenizer's")
    args = ap.parse_args()
    print(make_random_model(args.arch, args.out, args.seed, device=args.device,  # noqa: T201
                            real_vocab=args.real_vocab))
    if args.gsm8k:
        print(write_synthetic_gsm8k(args.gsm8k, args.gsm8k_size, args.seed))  # noqa: T201


if __name__ == "__main__":
    main()
