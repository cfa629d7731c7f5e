"""The custom Kedro datasets: per-step tables, the training-state hand-off, the checkpoint root, the
policy, HF model directories, and the atomic versioned tables and plots."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
import torch
from kedro.io.core import DatasetError, Version

from qerl.datasets import (
    CheckpointStoreDataset,
    CSVTable,
    FiguresDataset,
    HFModelDataset,
    ParquetTable,
    PolicyDataset,
    ReplayHandle,
    StepTablesDataset,
    TrainStateDataset,
)
from qerl.train.checkpoints import CheckpointStore

torch.set_num_threads(1)

V1, V2 = "2024-01-01T00.00.00.000Z", "2024-01-02T00.00.00.000Z"


def _table(step: int = 1, run: str = "r/fp1", n: int = 3, tag: str = "a", replay: bool = False) -> pd.DataFrame:
    return pd.DataFrame({"run": run, "step": step, "completion": [f"{tag}{i}" for i in range(n)],
                         "ids": [[i, i + 1] for i in range(n)], "replay": replay})


def _no_partials(root: Path) -> bool:
    return not any(p.name.startswith((".partial-", ".old-")) for p in root.rglob("*"))


# ------------------------------------------------------------------ StepTablesDataset


def test_step_tables_hand_off_then_training_record(tmp_path: Path) -> None:
    ds = StepTablesDataset(path=str(tmp_path / "rollouts"))
    with pytest.raises(DatasetError, match="kedro run --pipelines=qerl_train"):
        ds.load()
    for step in (1, 2):
        ds.save(_table(step, tag=f"s{step}-"))
        assert ds.load()["step"].iloc[0] == step  # within a run: the table just saved
    ds.save(_table(2, tag="replayed-", replay=True))
    assert _no_partials(tmp_path)
    files = sorted(p.name for p in (tmp_path / "rollouts" / "r" / "fp1" / "step_000002").iterdir())
    assert len(files) == 2 and files[1].endswith(".replay.parquet")
    fresh = StepTablesDataset(path=str(tmp_path / "rollouts"))  # a notebook: the training record
    record = fresh.load()
    assert list(record["step"]) == [1] * 3 + [2] * 3 and not record["completion"].str.startswith("replayed").any()
    replays = StepTablesDataset(path=str(tmp_path / "rollouts"), load_args={"replays": True}).load()
    assert list(replays["completion"]) == ["replayed-0", "replayed-1", "replayed-2"]
    fresh.save(_table(1, run="other/fp9", tag="o"))
    assert fresh.runs()[-1] == "other/fp9" and fresh.read("r/fp1", 1)["completion"].iloc[0] == "s1-0"
    pinned = StepTablesDataset(path=str(tmp_path / "rollouts"), load_args={"run": "r/fp1"})
    assert set(pinned.load()["step"]) == {1, 2}
    with pytest.raises(DatasetError, match="exactly one 'step'"):
        fresh.save(pd.concat([_table(1), _table(2)]))


def test_step_tables_failed_write_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    ds = StepTablesDataset(path=str(tmp_path / "t"))
    ds.save(_table(1))

    def boom(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", boom)
    with pytest.raises(DatasetError, match="disk full"):
        ds.save(_table(2))
    assert _no_partials(tmp_path) and StepTablesDataset(path=str(tmp_path / "t")).steps("r/fp1") == [1]


# ------------------------------------------------------------------ training state and checkpoints


def test_train_state_dataset_resident_or_replay_handle(tmp_path: Path) -> None:
    ds = TrainStateDataset(checkpoints=str(tmp_path / "ckpt"))
    handle = ds.load()
    assert isinstance(handle, ReplayHandle) and handle.store.root == tmp_path / "ckpt" and not handle.resident
    state = object()
    ds.save(state)
    assert ds.load() is state and ds.exists()
    ds.release()
    assert isinstance(ds.load(), ReplayHandle)
    store = CheckpointStoreDataset(path=str(tmp_path / "ckpt")).load()
    assert isinstance(store, CheckpointStore) and store.root == tmp_path / "ckpt"
    with pytest.raises(DatasetError):
        CheckpointStoreDataset(path=str(tmp_path)).save(None)


# ------------------------------------------------------------------ atomic tables and plots


@pytest.mark.parametrize("cls,name", [(ParquetTable, "t.parquet"), (CSVTable, "t.csv")])
def test_tables_write_atomically_and_a_failed_write_keeps_the_newest_version(tmp_path: Path, monkeypatch, cls,
                                                                           name: str) -> None:
    df = pd.DataFrame({"a": [1, 2], "b": ["x", "y"]})
    cls(filepath=str(tmp_path / name), version=Version(None, V1)).save(df)
    writer = "to_parquet" if cls is ParquetTable else "to_csv"

    def half_then_die(self, path, *a, **k):
        Path(path).write_bytes(b"PAR1 truncated")
        raise OSError("killed mid-write")

    monkeypatch.setattr(pd.DataFrame, writer, half_then_die)
    with pytest.raises(DatasetError, match="killed"):
        cls(filepath=str(tmp_path / name), version=Version(None, V2)).save(df.assign(a=[3, 4]))
    monkeypatch.undo()
    assert _no_partials(tmp_path)
    newest = cls(filepath=str(tmp_path / name), version=Version(None, None)).load()
    assert list(newest["a"]) == [1, 2]  # the previous version is still the newest and loads


def test_figures_dataset_saves_pngs_atomically_and_loads_images(tmp_path: Path) -> None:
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    ds = FiguresDataset(filepath=str(tmp_path / "plots"), version=Version(None, V1))
    ds.save({"curve.png": fig, "other.png": plt.figure()})
    assert sorted(p.name for p in (tmp_path / "plots" / V1 / "plots").iterdir()) == ["curve.png", "other.png"]
    images = FiguresDataset(filepath=str(tmp_path / "plots"), version=Version(None, None)).load()
    assert sorted(images) == ["curve.png", "other.png"] and images["curve.png"].size[0] > 100
    assert _no_partials(tmp_path)


def _policy(tiny_model_dir: Path, fmt: str = "nvfp4"):
    from qerl.params import LoraParams, ModelParams, QuantParams
    from qerl.train.policy import build_policy

    return build_policy(ModelParams(path=str(tiny_model_dir), device="cpu"), QuantParams(format=fmt),
                        LoraParams(r=4, alpha=8))[0]


def test_policy_dataset_resident_then_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = _policy(tiny_model_dir)
    path = tmp_path / "policy"
    ds = PolicyDataset(path=str(path))
    ds.save(policy)
    assert ds.load() is policy and ds.load() is policy
    assert (path / "policy.json").is_file() and (path / "base" / "model.safetensors").is_file()
    assert _no_partials(tmp_path)

    rebuilt = PolicyDataset(path=str(path))
    assert rebuilt.exists()
    other = rebuilt.load()
    assert other is not policy and other.identity() == policy.identity()
    assert rebuilt.load() is other  # resident after the first load
    a = {k: v for k, v in policy.model.state_dict().items() if "lora_" not in k}
    b = {k: v for k, v in other.model.state_dict().items() if "lora_" not in k}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_policy_dataset_no_persist_and_missing(tiny_model_dir: Path, tmp_path: Path) -> None:
    ds = PolicyDataset(path=str(tmp_path / "p"), persist=False)
    assert not ds.exists()
    with pytest.raises(DatasetError, match=r"kedro run --pipelines=qerl_train"):
        ds.load()
    policy = _policy(tiny_model_dir, "none")
    ds.save(policy)
    assert ds.load() is policy and not (tmp_path / "p").exists()
    ds.release()
    with pytest.raises(DatasetError, match="setup_quantized_policy"):
        ds.load()


# ------------------------------------------------------------------ HFModelDataset


def test_hf_model_dataset_atomic_save_and_load(tiny_model_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from qerl.modeling.tiny import load_tiny

    model, tok = load_tiny(tiny_model_dir)
    out = tmp_path / "models" / "embedded"
    ds = HFModelDataset(path=str(out))
    assert not ds.exists()
    with pytest.raises(DatasetError, match="kedro run --pipeline=embedded_model"):
        ds.load()
    ds.save({"model": model, "tokenizer": tok})
    assert ds.exists() and (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert _no_partials(tmp_path)
    back = ds.load()
    assert back["path"] == str(out)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(back["model"](input_ids=ids).logits, model(input_ids=ids).logits, atol=0, rtol=0)
    assert back["tokenizer"]("a b c")["input_ids"] == tok("a b c")["input_ids"]

    # a failing save leaves the previous model in place and no temporary directory
    def boom(*a, **k):
        raise OSError("killed mid-write")

    monkeypatch.setattr(type(tok), "save_pretrained", boom)
    with pytest.raises(DatasetError, match="killed mid-write"):
        ds.save({"model": model, "tokenizer": tok})
    assert _no_partials(tmp_path)
    assert sorted(p.name for p in out.parent.iterdir()) == ["embedded"]
    assert ds.load()["model"].config.hidden_size == 64

    # a successful overwrite replaces it atomically
    monkeypatch.undo()
    model.config.tag_for_test = "second"
    ds.save({"model": model, "tokenizer": tok})
    assert sorted(p.name for p in out.parent.iterdir()) == ["embedded"]
    assert ds.load()["model"].config.tag_for_test == "second"
