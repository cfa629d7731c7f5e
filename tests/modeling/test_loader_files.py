"""Corrupt, truncated or foreign model files: one clear error naming the file, before heavy work."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import qerl.modeling.loader as loader
from qerl.errors import QerlConfigError
from qerl.modeling.loader import load_policy_base, load_quantized, save_quantized
from qerl.modeling.weights import check_safetensors_file, weight_files

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def sharded_dir(
    tiny_model_factory: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A tiny model saved as several shards + index (and its tokenizer)."""
    model, tok, _ = load_policy_base(tiny_model_factory(), "none")
    out = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(str(out), max_shard_size="40KB")
    tok.save_pretrained(str(out))
    assert len(list(out.glob("model-*.safetensors"))) > 2
    return out


@pytest.fixture
def no_heavy_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the loader gets as far as the tokenizer, a model build or an unpickle."""

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("heavy work started before the weight files were checked")

    for name in ("load_tokenizer", "_from_pretrained", "build_skeleton"):
        monkeypatch.setattr(loader, name, boom)
    monkeypatch.setattr(torch, "load", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "loads", boom)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _refused(path: Path, fmt: str = "nvfp4") -> QerlConfigError:
    with pytest.raises(QerlConfigError) as info:
        load_policy_base(path, fmt)
    assert info.value.field == "model.path"
    return info.value


@pytest.mark.usefixtures("no_heavy_work")
@pytest.mark.parametrize("fmt", ["none", "nf4", "nvfp4"])
def test_truncated_file(tiny_model_dir: Path, tmp_path: Path, fmt: str) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    err = _refused(model_dir, fmt)
    assert err.problem.startswith(f"{weights} is truncated: its header declares")
    assert "copy or download the file again" in err.fix


@pytest.mark.usefixtures("no_heavy_work")
def test_truncated_inside_the_header(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    assert "is truncated: its header alone should take" in _refused(model_dir).problem


@pytest.mark.usefixtures("no_heavy_work")
def test_garbage_bytes(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 64)
    err = _refused(model_dir)
    assert err.problem == f"{weights} is not a safetensors file (no JSON header after the length)"


@pytest.mark.usefixtures("no_heavy_work")
@pytest.mark.parametrize("zipfile", [True, False])
def test_torch_pickle_in_place_of_safetensors(
    tiny_model_dir: Path, tmp_path: Path, zipfile: bool
) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    weights = model_dir / "model.safetensors"
    torch.save({"w": torch.zeros(4)}, str(weights), _use_new_zipfile_serialization=zipfile)
    err = _refused(model_dir)
    assert err.problem.startswith(f"{weights} is not a safetensors file (looks like a")
    assert "pickle" in err.problem
    assert "safe_serialization=True" in err.fix and "never unpickles foreign files" in err.fix


@pytest.mark.usefixtures("no_heavy_work")
def test_only_pickled_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    torch.save({"w": torch.zeros(4)}, str(model_dir / "pytorch_model.bin"))
    err = _refused(model_dir)
    assert "only pickled weights ['pytorch_model.bin']" in err.problem and "never loaded" in err.fix


@pytest.mark.usefixtures("no_heavy_work")
def test_corrupt_header_entries(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(tiny_model_dir, tmp_path / "m")
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [s * 2 for s in header[name]["shape"]]
    raw = json.dumps(header).encode()
    weights.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])
    assert f"is corrupt: tensor {name!r}" in _refused(model_dir).problem


@pytest.mark.usefixtures("no_heavy_work")
def test_truncated_shard_of_an_index(sharded_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(sharded_dir, tmp_path / "m")
    shard = sorted(model_dir.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    assert _refused(model_dir).problem.startswith(f"{shard} is truncated")


@pytest.mark.usefixtures("no_heavy_work")
def test_index_naming_a_missing_shard(sharded_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(sharded_dir, tmp_path / "m")
    shard = sorted(model_dir.glob("model-*.safetensors"))[1]
    shard.unlink()
    err = _refused(model_dir)
    index = model_dir / "model.safetensors.index.json"
    assert err.problem == f"{index} names 1 shard(s) that are missing: [{shard.name!r}]"
    assert "every shard the index lists" in err.fix


@pytest.mark.usefixtures("no_heavy_work")
def test_index_naming_a_tensor_its_shard_lacks(sharded_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(sharded_dir, tmp_path / "m")
    index = model_dir / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    first, last = (
        sorted(set(raw["weight_map"].values()))[0],
        sorted(set(raw["weight_map"].values()))[-1],
    )
    moved = next(k for k, v in raw["weight_map"].items() if v == first)
    raw["weight_map"][moved] = last
    index.write_text(json.dumps(raw))
    err = _refused(model_dir)
    assert err.problem == f"{index} places tensor {moved!r} in {last}, which does not hold it"


@pytest.mark.usefixtures("no_heavy_work")
def test_index_that_is_not_json(sharded_dir: Path, tmp_path: Path) -> None:
    model_dir = _copy(sharded_dir, tmp_path / "m")
    (model_dir / "model.safetensors.index.json").write_text("{not json")
    assert "is not a valid safetensors index" in _refused(model_dir).problem


def test_load_quantized_checks_its_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, tok, _ = load_policy_base(tiny_model_dir, "nvfp4")
    out = save_quantized(model, tok, tmp_path / "q")
    weights = out / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])
    with pytest.raises(QerlConfigError) as info:
        load_quantized(out)
    assert info.value.field == "checkpoint.path" and f"{weights} is truncated" in info.value.problem


def test_good_files_pass_and_headers_are_returned(sharded_dir: Path, tiny_model_dir: Path) -> None:
    headers = weight_files(sharded_dir)
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert {k for h in headers.values() for k in h if k != "__metadata__"} == set(index)
    single = check_safetensors_file(tiny_model_dir / "model.safetensors")
    assert single["model.layers.0.mlp.up_proj.weight"]["shape"] == [128, 64]
