"""The embedded default model: a small local tokenizer and a tiny real-architecture causal LM.

Nothing here touches the network. The tokenizer is built with the ``tokenizers`` library and wrapped
as a transformers :class:`~transformers.PreTrainedTokenizerFast`, so it saves with
``save_pretrained`` and loads back with ``AutoTokenizer.from_pretrained(local_dir)``; the model is a
plain transformers Qwen2 (or Llama) config, so every downstream stage (quantization, peft LoRA,
``generate``, AQN on the RMSNorm weights) treats it exactly like a real checkpoint.

Tokenizer design
----------------
* Byte-level BPE: the base alphabet is the 256 byte symbols of GPT-2's byte-level mapping, so
  ``decode(encode(text)) == text`` for *any* text (task prompts of other generators included).
* Digits are always split into single tokens (``Digits(individual_digits=True)``), so arithmetic is
  seen digit by digit; no merge ever crosses a digit boundary.
* Optional merges are learned from a small corpus (e.g. the task's prompts). With ``use_regex=False``
  a whole run of non-digit text is one pre-token, so a fixed boilerplate sentence becomes one or a
  few tokens and prompts stay short. With no corpus the tokenizer is purely byte-level.
* ``<think>``, ``</think>``, ``<answer>``, ``</answer>`` are single *non-special* added tokens
  (they survive ``decode(..., skip_special_tokens=True)``, like Qwen3's think tags); ``<|pad|>``
  and ``<|endoftext|>`` (eos) are special tokens. No BOS is added.

Model spec
----------
:class:`TinyModelSpec` builds a transformers config in which every ``nn.Linear`` input dimension is
a multiple of 64 (so NVFP4 with block 16 and MXFP4 with block 32 quantize every layer).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
FORMAT_TOKENS: tuple[str, ...] = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"

#: vocab rows of the model are rounded up to this multiple (the embedding / lm_head rows).
VOCAB_MULTIPLE = 64


def build_tokenizer(corpus: Iterable[str] | None = None, vocab_size: int = 384):
    """Build the local byte-level BPE tokenizer.

    Args:
        corpus: texts to learn merges from (e.g. a few thousand task prompts). ``None`` or empty
            gives a pure byte-level tokenizer (no merges). Merge learning is deterministic for a
            given corpus (same texts in the same order give the same vocabulary).
        vocab_size: target size of the BPE vocabulary including the 256 byte symbols and the two
            special tokens (the 4 format tokens come on top). Ignored when ``corpus`` is empty.

    Returns:
        A :class:`transformers.PreTrainedTokenizerFast` with ``pad_token``, ``eos_token`` and the
        four format tokens as single ids. ``padding_side`` is ``"left"`` (generation batches).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level]
    )
    tok.decoder = decoders.ByteLevel()
    texts = []
    for t in corpus or []:  # the format tags are added tokens: learn no merges from them
        for tag in FORMAT_TOKENS:
            t = t.replace(tag, "\x00")
        texts.extend(piece for piece in t.split("\x00") if piece)
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, 258) if texts else 258,
        min_frequency=2,
        special_tokens=[PAD_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts if texts else [""], trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in FORMAT_TOKENS])

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    return hf


def format_token_ids(tokenizer) -> dict[str, int]:
    """Ids of the four format tokens (each must be a single token)."""
    out = {}
    for t in FORMAT_TOKENS:
        ids = tokenizer.encode(t, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"tokenizer: {t!r} is not a single token ({ids})")
        out[t] = ids[0]
    return out


def round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


@dataclass
class TinyModelSpec:
    """Shape of the embedded default causal LM.

    Every Linear input dimension (``hidden_size`` for q/k/v/o/gate/up, ``intermediate_size`` for
    down) must be a multiple of 64; ``head_dim = hidden_size // num_attention_heads``.
    """

    # "llama" by default: transformers' AutoTokenizer swaps in Qwen2Tokenizer (which rebuilds its own
    # pre-tokenizer) for any directory whose config.json says qwen2; with llama it loads ours as is.
    architecture: str = "llama"  # "llama" | "qwen2"
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    intermediate_size: int = 384
    max_position_embeddings: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    initializer_range: float = 0.02

    def validate(self) -> None:
        from qerl.errors import QerlConfigError

        if self.architecture not in ("qwen2", "llama"):
            raise QerlConfigError(
                "model.architecture",
                f"unknown architecture {self.architecture!r}",
                "use 'qwen2' or 'llama'",
            )
        for name in ("hidden_size", "intermediate_size"):
            v = getattr(self, name)
            if v <= 0 or v % 64:
                raise QerlConfigError(
                    f"model.{name}",
                    f"{v} is not a positive multiple of 64 (NVFP4/MXFP4 blocks must tile every Linear input)",
                    f"use e.g. {max(64, round_up(max(v, 1), 64))}",
                )
        if self.hidden_size % self.num_attention_heads:
            raise QerlConfigError(
                "model.num_attention_heads",
                f"hidden_size {self.hidden_size} is not divisible by {self.num_attention_heads} heads",
                "pick a head count that divides hidden_size",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise QerlConfigError(
                "model.num_key_value_heads",
                f"{self.num_attention_heads} heads are not a multiple of {self.num_key_value_heads} kv heads",
                "pick a kv head count that divides num_attention_heads",
            )
        kv_out = self.hidden_size // self.num_attention_heads * self.num_key_value_heads
        if kv_out % 16:
            raise QerlConfigError(
                "model.num_key_value_heads",
                f"k/v projection width {kv_out} is not a multiple of 16",
                "use more kv heads or a larger head_dim",
            )
        if self.num_hidden_layers < 1:
            raise QerlConfigError("model.num_hidden_layers", "must be >= 1", "use e.g. 2")

    def to_dict(self) -> dict:
        return asdict(self)


def build_config(spec: TinyModelSpec, tokenizer):
    """A transformers config (Qwen2Config or LlamaConfig) for ``spec`` and ``tokenizer``.

    The vocabulary is rounded up to a multiple of 64 rows; pad/eos ids come from the tokenizer.
    """
    spec.validate()
    common = dict(
        vocab_size=round_up(len(tokenizer), VOCAB_MULTIPLE),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings,
        initializer_range=spec.initializer_range,
        hidden_act="silu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_cache=True,
    )
    if spec.architecture == "qwen2":
        from transformers import Qwen2Config

        cfg = Qwen2Config(
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta}, **common
        )
    else:
        from transformers import LlamaConfig

        cfg = LlamaConfig(
            rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
            attention_bias=False,
            mlp_bias=False,
            **common,
        )
    return cfg


def build_model(spec: TinyModelSpec, tokenizer, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A freshly initialised causal LM for ``spec`` (deterministic given ``seed``)."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    cfg = build_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        do_sample=False,
    )
    return model


def linear_in_features(model: torch.nn.Module, include_lm_head: bool = False) -> dict[str, int]:
    """Input width of every ``nn.Linear`` (by module name); ``lm_head`` excluded by default."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and (include_lm_head or not name.endswith("lm_head")):
            out[name] = mod.in_features
    return out


def save_tiny(model, tokenizer, path: str | os.PathLike) -> None:
    """Save model (safetensors) and tokenizer to a local directory."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)


def load_tiny(path: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """Load what :func:`save_tiny` wrote (local files only, no remote code)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    # not AutoTokenizer: for a qwen2 config it would load Qwen2Tokenizer and re-split the text
    tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    return model, tok
