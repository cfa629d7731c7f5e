"""The custom Kedro datasets of the training pipeline: step tables, training state, policy, HF model."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from kedro.io.core import DatasetError, Version

from qerl.datasets import (
    SKIPPED,
    HFModelDataset,
    PolicyDataset,
    StepTableDataset,
    TrainStateDataset,
    is_skipped,
)
from qerl.train.state import TrainState, save_checkpoint

torch.set_num_threads(1)

V1, V2 = "2024-01-01T00.00.00.000Z", "2024-01-02T00.00.00.000Z"


def _table(n: int = 3, tag: str = "a") -> pd.DataFrame:
    return pd.DataFrame(
        {"step": [1] * n, "completion": [f"{tag}{i}" for i in range(n)], "ids": [[i, i + 1] for i in range(n)]}
    )


def _no_partials(root: Path) -> bool:
    return not any(p.name.startswith((".partial-", ".old-")) for p in root.rglob("*"))


# ------------------------------------------------------------------ StepTableDataset


def test_step_table_versions(tmp_path: Path) -> None:
    fp = str(tmp_path / "rollouts.parquet")
    StepTableDataset(filepath=fp, version=Version(None, V1)).save(_table(tag="a"))
    StepTableDataset(filepath=fp, version=Version(None, V2)).save(_table(tag="b"))
    ds = StepTableDataset(filepath=fp, version=Version(None, None))
    assert ds.list_versions() == [V2, V1]
    assert ds.list_versions(full_path=True) == [f"{fp}/{V2}/rollouts.parquet", f"{fp}/{V1}/rollouts.parquet"]
    assert (tmp_path / "rollouts.parquet" / V1 / "rollouts.parquet").is_file()
    assert ds.exists()

    newest = ds.load()
    assert list(newest["completion"]) == ["b0", "b1", "b2"]
    assert [list(x) for x in newest["ids"]] == [[0, 1], [1, 2], [2, 3]]
    pinned = StepTableDataset(filepath=fp, version=Version(V1, None)).load()
    assert list(pinned["completion"]) == ["a0", "a1", "a2"]
    assert _no_partials(tmp_path)

    with pytest.raises(DatasetError, match="must not exist"):
        StepTableDataset(filepath=fp, version=Version(None, V1)).save(_table())


def test_step_table_unversioned_round_trip(tmp_path: Path) -> None:
    ds = StepTableDataset(filepath=str(tmp_path / "t.parquet"))
    assert not ds.exists()
    ds.save(_table())
    pd.testing.assert_frame_equal(ds.load().drop(columns="ids"), _table().drop(columns="ids"))
    assert ds.list_versions() == []


def test_step_table_skipped_is_not_written(tmp_path: Path) -> None:
    fp = str(tmp_path / "scored.parquet")
    ds = StepTableDataset(filepath=fp, version=Version(None, V1))
    ds.save(SKIPPED)
    assert not (tmp_path / "scored.parquet").exists()
    back = ds.load()
    assert is_skipped(back) and back is SKIPPED
    assert ds.list_versions() == []
    assert not is_skipped(_table()) and not is_skipped(None)
    # a real save after a skip is written and loads back for real
    ds.save(_table(tag="z"))
    assert list(ds.load()["completion"]) == ["z0", "z1", "z2"]
    # another process (a fresh dataset object) never sees the skip marker
    with pytest.raises(DatasetError, match=r"kedro run --pipeline=qerl_train"):
        StepTableDataset(filepath=str(tmp_path / "other.parquet"), version=Version(None, None)).load()


def test_step_table_missing_version_names_the_pipeline(tmp_path: Path) -> None:
    ds = StepTableDataset(filepath=str(tmp_path / "r.parquet"), version=Version(None, None))
    assert not ds.exists()
    with pytest.raises(DatasetError, match=r"`kedro run --pipeline=qerl_train`"):
        ds.load()
    pinned = StepTableDataset(filepath=str(tmp_path / "r.parquet"), version=Version(V1, None))
    with pytest.raises(DatasetError, match=r"kedro run --pipeline=qerl_train"):
        pinned.load()
    other = StepTableDataset(filepath=str(tmp_path / "r.parquet"), version=Version(None, None), producer="eval")
    with pytest.raises(DatasetError, match=r"kedro run --pipeline=eval"):
        other.load()


def test_step_table_failed_write_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    def boom(self, *a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", boom)
    ds = StepTableDataset(filepath=str(tmp_path / "r.parquet"), version=Version(None, V1))
    with pytest.raises(DatasetError, match="disk full"):  # Kedro wraps the error of save()
        ds.save(_table())
    assert not (tmp_path / "r.parquet" / V1 / "r.parquet").exists()
    assert _no_partials(tmp_path)
    assert ds.list_versions() == []


# ------------------------------------------------------------------ TrainStateDataset


def _checkpoint(root: Path, step: int, run: str = "run", fp: str = "fp") -> dict[str, torch.Tensor]:
    adapter = {"layer.lora_A.weight": torch.full((2, 3), float(step)), "layer.lora_B.weight": torch.ones(3, 2)}
    st = TrainState(run_name=run, fingerprint=fp, total_steps=9, save_every=1, step=step,
                    history=[{"step": s, "reward_mean": s / 10} for s in range(1, step + 1)], noise=None)
    save_checkpoint(st, adapter, root)
    return adapter


def test_train_state_dataset_resident_identity(tmp_path: Path) -> None:
    ds = TrainStateDataset(checkpoint_root=str(tmp_path))
    st = TrainState(run_name="r", fingerprint="f", total_steps=3, save_every=1)
    ds.save(st)
    assert ds.load() is st and ds.load() is st
    st.step = 2  # mutations are visible: no copy
    assert ds.load().step == 2
    assert ds.exists()
    ds.release()
    with pytest.raises(DatasetError):
        ds.load()


def test_train_state_dataset_falls_back_to_latest_checkpoint(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 2)
    latest = _checkpoint(tmp_path, 4)
    ds = TrainStateDataset(checkpoint_root=str(tmp_path))
    assert ds.exists()
    st = ds.load()
    assert not st.resident and st.step == 4 and (st.run_name, st.fingerprint, st.total_steps) == ("run", "fp", 9)
    assert st.optimizer is None
    assert st.adapter is not None and st.adapter.keys() == latest.keys()
    assert all(torch.equal(st.adapter[k], latest[k]) for k in latest)
    assert [h["step"] for h in st.history] == [1, 2, 3, 4]
    assert st.checkpoint_dir == str(tmp_path / "run" / "fp" / "step_000004")


def test_train_state_dataset_missing_names_the_pipeline(tmp_path: Path) -> None:
    ds = TrainStateDataset(checkpoint_root=str(tmp_path / "none"))
    assert not ds.exists()
    with pytest.raises(DatasetError, match=r"kedro run --pipeline=qerl_train"):
        ds.load()
    # an incomplete checkpoint directory is not a checkpoint
    (tmp_path / "none" / "run" / "fp" / "step_000001").mkdir(parents=True)
    with pytest.raises(DatasetError, match=r"kedro run --pipeline=qerl_train"):
        ds.load()


# ------------------------------------------------------------------ PolicyDataset


def _policy(tiny_model_dir: Path, fmt: str = "nvfp4"):
    from qerl.train.policy import PolicySpec, build_policy

    return build_policy(PolicySpec(model_path=str(tiny_model_dir), format=fmt, device="cpu", lora={"r": 4, "alpha": 8}))[0]


def test_policy_dataset_resident_then_disk(tiny_model_dir: Path, tmp_path: Path) -> None:
    policy = _policy(tiny_model_dir)
    path = tmp_path / "policy"
    ds = PolicyDataset(path=str(path))
    ds.save(policy)
    assert ds.load() is policy and ds.load() is policy
    assert (path / "spec.json").is_file() and (path / "base" / "model.safetensors").is_file()
    assert _no_partials(tmp_path)

    rebuilt = PolicyDataset(path=str(path))
    assert rebuilt.exists()
    other = rebuilt.load()
    assert other is not policy and other.spec == policy.spec
    assert rebuilt.load() is other  # resident after the first load
    a = {k: v for k, v in policy.model.state_dict().items() if "lora_" not in k}
    b = {k: v for k, v in other.model.state_dict().items() if "lora_" not in k}
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_policy_dataset_no_persist_and_missing(tiny_model_dir: Path, tmp_path: Path) -> None:
    ds = PolicyDataset(path=str(tmp_path / "p"), persist=False)
    assert not ds.exists()
    with pytest.raises(DatasetError, match=r"kedro run --pipeline=qerl_train"):
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
