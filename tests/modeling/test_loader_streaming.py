"""Quantizing one layer at a time, while a sharded checkpoint streams or a random model is built:
the same bits as the unsharded checkpoint, and at most one full-precision Linear weight alive at
any quantization step (counted through the GC)."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from qerl.modeling.loader import load_policy_base
from qerl.modeling.random_init import build_random_policy_base
from qerl.quant.linear import QuantLinear

torch.set_num_threads(1)

VOCAB = 80  # the embedding [80, 64] has a shape no Linear weight has


@pytest.fixture(scope="module")
def model_dirs(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """(single-file checkpoint, the same weights as index + shards)."""
    single = tiny_model_factory(vocab_size=VOCAB)
    model, tok, _ = load_policy_base(single, "none")
    sharded = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(str(sharded), max_shard_size="40KB")
    tok.save_pretrained(str(sharded))
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    return single, sharded


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _state_bits(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: _bits(v) for k, v in model.state_dict().items()}


def _linear_shapes(model_dir: Path) -> set[tuple[int, int]]:
    model, _, _ = load_policy_base(model_dir, "none")
    shapes = {tuple(m.weight.shape) for n, m in model.named_modules() if type(m) is nn.Linear}
    shapes.discard((VOCAB, 64))  # lm_head (tied, kept full precision)
    return shapes  # type: ignore[return-value]


def live_float_weights(shapes: set[tuple[int, int]]) -> int:
    """Distinct storages of live, real (not meta) float tensors shaped like a Linear weight."""
    storages = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if (
                isinstance(obj, torch.Tensor)
                and not obj.is_meta
                and obj.is_floating_point()
                and tuple(obj.shape) in shapes
            ):
                storages.add(obj.untyped_storage().data_ptr())
    return len(storages)


@pytest.fixture
def count_at_quantization(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[[set[tuple[int, int]]], list[int]]]:
    """Record ``live_float_weights`` each time a layer is quantized (ours and bitsandbytes')."""
    counts: list[int] = []
    shapes: set[tuple[int, int]] = set()
    original = QuantLinear.set_quantized_weight

    def ours(self: QuantLinear, weight: torch.Tensor) -> None:
        counts.append(live_float_weights(shapes))
        original(self, weight)

    monkeypatch.setattr(QuantLinear, "set_quantized_weight", ours)
    try:
        import bitsandbytes.functional as bnbf
    except ImportError:
        bnbf = None
    if bnbf is not None:
        bnb_original = bnbf.quantize_4bit

        def theirs(a: torch.Tensor, *args: object, **kwargs: object) -> object:
            counts.append(live_float_weights(shapes))
            return bnb_original(a, *args, **kwargs)

        monkeypatch.setattr(bnbf, "quantize_4bit", theirs)

    def start(linear_shapes: set[tuple[int, int]]) -> list[int]:
        shapes.update(linear_shapes)
        return counts

    yield start


@pytest.mark.parametrize("fmt", ["none", "nvfp4", "mxfp4", "nf4"])
def test_sharded_load_equals_unsharded_bit_for_bit(model_dirs: tuple[Path, Path], fmt: str) -> None:
    if fmt == "nf4":
        pytest.importorskip("bitsandbytes")
    single, sharded = model_dirs
    a, _, rows_a = load_policy_base(single, fmt)
    b, _, rows_b = load_policy_base(sharded, fmt)
    bits_a, bits_b = _state_bits(a), _state_bits(b)
    assert bits_a.keys() == bits_b.keys()
    for key, value in bits_a.items():
        assert torch.equal(value, bits_b[key]), key
    assert rows_a == rows_b
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_one_full_precision_layer_weight_alive_at_a_time(
    model_dirs: tuple[Path, Path],
    count_at_quantization: Callable[[set[tuple[int, int]]], list[int]],
    fmt: str,
) -> None:
    if fmt == "nf4":
        pytest.importorskip("bitsandbytes")
    _, sharded = model_dirs
    shapes = _linear_shapes(sharded)
    gc.collect()
    assert live_float_weights(shapes) == 0  # the reference model above is gone
    counts = count_at_quantization(shapes)
    model, _, _ = load_policy_base(sharded, fmt)
    n_linear = 2 * 7
    assert len(counts) == n_linear  # every quantized layer was seen
    assert max(counts) == 1, counts  # only the weight being quantized; nothing read ahead or kept
    assert live_float_weights(shapes) == 0  # and no full-precision copy outlives the load
    assert (
        sum(type(m) is not nn.Linear for n, m in model.named_modules() if n.endswith("_proj"))
        == n_linear
    )


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_random_build_draws_and_quantizes_one_layer_at_a_time(
    model_dirs: tuple[Path, Path],
    count_at_quantization: Callable[[set[tuple[int, int]]], list[int]],
    fmt: str,
) -> None:
    if fmt == "nf4":
        pytest.importorskip("bitsandbytes")
    from transformers import AutoConfig

    single, _ = model_dirs
    shapes = _linear_shapes(single)
    gc.collect()
    counts = count_at_quantization(shapes)
    model = build_random_policy_base(AutoConfig.from_pretrained(single), fmt, "cpu", torch.float32)
    assert len(counts) == 2 * 7
    assert max(counts) == 1, counts
    assert live_float_weights(shapes) == 0
    assert isinstance(model.model.layers[1].mlp.down_proj, nn.Linear)  # QuantLinear / Linear4bit
    assert type(model.model.layers[1].mlp.down_proj) is not nn.Linear


def _mapped_files(directory: Path) -> set[str]:
    """Files under ``directory`` that this process has memory-mapped (Linux /proc)."""
    with open("/proc/self/maps") as maps:
        return {line.split()[-1] for line in maps if str(directory) in line}


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_no_shard_stays_mapped_after_the_load(model_dirs: tuple[Path, Path], fmt: str) -> None:
    # safetensors returns CPU tensors as views of the mapped file: a kept 1 KB bias would hold a
    # whole shard mapped (and the model tied to the file on disk); the loader copies what it keeps
    _, sharded = model_dirs
    model, _, _ = load_policy_base(sharded, fmt)
    gc.collect()
    assert _mapped_files(sharded) == set()
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() >= 0  # the model is alive
