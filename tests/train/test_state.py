"""Training state: LR schedule, atomic checkpoints, safe loading and resume."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch

import qerl.train.state as state_mod
from qerl.noise.schedules import StagedSchedule
from qerl.train.run import start_run
from qerl.train.state import (
    TrainState,
    build_optimizer,
    build_scheduler,
    fingerprint,
    list_checkpoints,
    load_checkpoint,
    run_dir,
    save_checkpoint,
)

_EVIL_RAN: list[str] = []


def _evil() -> str:
    _EVIL_RAN.append("ran")
    return "pwned"


class Evil:
    """Unpickling this runs code: a weights_only load must refuse it."""

    def __reduce__(self):
        return (_evil, ())


def _params(n: int = 2) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(3, 4, generator=gen)) for _ in range(n)]


def _lrs(total: int, warmup_ratio: float, kind: str) -> list[float]:
    opt = torch.optim.SGD(_params(1), lr=2.0)
    sched = build_scheduler(opt, total, warmup_ratio, kind)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(total):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def test_scheduler_warmup_then_cosine() -> None:
    lrs = _lrs(10, 0.2, "cosine")  # 2 warm-up steps, then 8 steps of cosine decay
    expected = [2.0 * 0.5, 2.0 * 1.0] + [2.0 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(9)]
    assert lrs == pytest.approx(expected, abs=1e-12)
    assert lrs[6] == pytest.approx(1.0)  # half way through the decay
    assert lrs[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:], strict=False))


def test_scheduler_constant_and_no_warmup() -> None:
    assert _lrs(8, 0.25, "constant") == pytest.approx([1.0, 2.0] + [2.0] * 7)
    lrs = _lrs(4, 0.0, "cosine")
    assert lrs == pytest.approx([2.0 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)])


def _state(step: int = 3, history: list | None = None, noise=None) -> TrainState:
    params = _params()
    opt = build_optimizer(params, "adamw", 1e-2, 0.01)
    sched = build_scheduler(opt, 10, 0.1, "cosine")
    (sum((p**2).sum() for p in params)).backward()
    opt.step()
    sched.step()
    return TrainState(
        run_name="run", fingerprint="abc123", total_steps=10, save_every=2, step=step, optimizer=opt,
        scheduler=sched, noise=noise, history=history if history is not None else [{"step": 1, "loss": 0.5}],
    )


def _adapter() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {"a.lora_A.weight": torch.randn(4, 8, generator=gen), "a.lora_B.weight": torch.randn(8, 4, generator=gen).t()}


def test_save_checkpoint_layout_and_contents(tmp_path: Path) -> None:
    noise = StagedSchedule("exponential", 1e-2, 1e-4, 4, 10)
    st = _state(step=3, noise=noise, history=[{"step": 1, "x": 1.0}, {"step": 2, "x": float("nan")}])
    st.bad_steps_total = 2
    adapter = _adapter()
    path = save_checkpoint(st, adapter, tmp_path)
    assert path == run_dir(tmp_path, "run", "abc123") / "step_000003"
    assert sorted(p.name for p in path.iterdir()) == ["adapter.safetensors", "optimizer.pt", "rng.pt", "trainer_state.json"]
    assert [p.name for p in path.parent.iterdir()] == ["step_000003"]  # no .partial-* left behind
    meta = json.loads((path / "trainer_state.json").read_text())
    assert (meta["step"], meta["run_name"], meta["fingerprint"], meta["total_steps"]) == (3, "run", "abc123", 10)
    assert meta["bad_steps_total"] == 2 and meta["noise"] == noise.state_dict()
    assert meta["history"][0] == {"step": 1, "x": 1.0} and math.isnan(meta["history"][1]["x"])

    ckpt = load_checkpoint(path)
    assert ckpt["path"] == str(path)
    assert ckpt["adapter"].keys() == adapter.keys()
    assert all(torch.equal(ckpt["adapter"][k], adapter[k]) for k in adapter)
    saved_opt = ckpt["optim"]["optimizer"]
    live_opt = st.optimizer.state_dict()
    assert saved_opt["param_groups"] == live_opt["param_groups"]
    for i, s in live_opt["state"].items():
        assert all(torch.equal(saved_opt["state"][i][k], v) for k, v in s.items())
    assert ckpt["optim"]["scheduler"]["last_epoch"] == 1
    assert set(ckpt["rng"]) >= {"torch", "python", "numpy"}


def test_save_checkpoint_rewrites_a_step_atomically(tmp_path: Path) -> None:
    st = _state(step=4)
    save_checkpoint(st, _adapter(), tmp_path)
    new = {k: v + 1 for k, v in _adapter().items()}
    path = save_checkpoint(st, new, tmp_path)
    assert [p.name for p in path.parent.iterdir()] == ["step_000004"]  # no .old-* / .partial-* left
    assert all(torch.equal(load_checkpoint(path)["adapter"][k], new[k]) for k in new)


def test_failed_checkpoint_write_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    def broken_save_file(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(state_mod, "save_file", broken_save_file)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(_state(step=2), _adapter(), tmp_path)
    fp_dir = run_dir(tmp_path, "run", "abc123")
    assert not (fp_dir / "step_000002").exists()
    leftovers = list(fp_dir.iterdir()) if fp_dir.exists() else []
    assert leftovers == []
    assert list_checkpoints(tmp_path, "run") == []


def test_failed_rewrite_keeps_the_old_checkpoint(tmp_path: Path, monkeypatch) -> None:
    st = _state(step=2)
    adapter = _adapter()
    path = save_checkpoint(st, adapter, tmp_path)

    real_save = torch.save

    def save_then_fail(obj, f, *a, **kw):
        if str(f).endswith("rng.pt"):
            raise OSError("killed")
        return real_save(obj, f, *a, **kw)

    monkeypatch.setattr(state_mod.torch, "save", save_then_fail)
    with pytest.raises(OSError, match="killed"):
        save_checkpoint(st, {k: v * 0 for k, v in adapter.items()}, tmp_path)
    assert [p.name for p in path.parent.iterdir()] == ["step_000002"]
    assert all(torch.equal(load_checkpoint(path)["adapter"][k], adapter[k]) for k in adapter)


def test_load_checkpoint_never_unpickles_arbitrary_objects(tmp_path: Path, monkeypatch) -> None:
    path = save_checkpoint(_state(), _adapter(), tmp_path)
    calls: list[dict] = []
    real_load = torch.load

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(state_mod.torch, "load", spy)
    load_checkpoint(path)
    assert len(calls) == 2 and all(c.get("weights_only") is True for c in calls)
    monkeypatch.undo()

    torch.save({"optimizer": Evil(), "scheduler": None}, path / "optimizer.pt")
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path)
    assert _EVIL_RAN == []


def test_list_checkpoints_ignores_incomplete_dirs(tmp_path: Path) -> None:
    st = _state()
    for step in (10, 2, 1):
        st.step = step
        save_checkpoint(st, _adapter(), tmp_path)
    base = run_dir(tmp_path, "run", "abc123")
    (base / "step_000007").mkdir()  # killed before trainer_state.json (never renamed in, but be safe)
    (base / "step_000007" / "adapter.safetensors").write_bytes(b"")
    partial = base / ".partial-xyz"
    partial.mkdir()
    (partial / "trainer_state.json").write_text("{}")
    other = TrainState(run_name="run", fingerprint="other", total_steps=10, save_every=1, step=5)
    save_checkpoint(other, _adapter(), tmp_path)

    assert [p.name for p in list_checkpoints(tmp_path, "run", "abc123")] == ["step_000001", "step_000002", "step_000010"]
    assert [p.name for p in list_checkpoints(tmp_path, "run", "other")] == ["step_000005"]
    assert [p.name for p in list_checkpoints(tmp_path, "run")] == [
        "step_000001", "step_000002", "step_000005", "step_000010"
    ]
    assert list_checkpoints(tmp_path, "nope") == []


def test_fingerprint_is_stable_and_sensitive() -> None:
    a = {"lr": 1e-5, "model": {"path": "x", "format": "nvfp4"}}
    assert fingerprint(a) == fingerprint({"model": {"format": "nvfp4", "path": "x"}, "lr": 1e-5})
    assert fingerprint(a) != fingerprint({**a, "lr": 2e-5})
    assert len(fingerprint(a)) == 10


# ------------------------------------------------------------------ resume through start_run


def _start(policy, root: Path, fp: str = "fp1", resume: str = "auto"):
    return start_run(
        policy, run_name="run", fingerprint=fp, total_steps=6, save_every=2, optimizer="adamw", lr=1e-2,
        weight_decay=0.0, warmup_ratio=0.5, lr_schedule="cosine", optimizer_steps_per_step=1,
        noise=StagedSchedule("linear", 1e-2, 1e-3, 3, 6), checkpoint_root=root, resume=resume,
    )


def _train_a_little(policy, state, n: int) -> None:
    for _ in range(n):
        loss = sum((p.float() ** 2).sum() for p in policy.lora_parameters())
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()


def test_start_run_resumes_exactly(make_policy, helpers, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    policy = make_policy("nvfp4", lora_seed=11)
    state = _start(policy, root)
    assert state.step == 0 and state.history == [] and state.checkpoint_dir is None
    _train_a_little(policy, state, 2)
    state.step = 2
    state.history = [{"step": 1, "reward_mean": 0.25}, {"step": 2, "reward_mean": 0.5}]
    state.bad_steps_total = 1
    saved = save_checkpoint(state, policy.adapter_state_dict(), root)
    next_draw = torch.rand(5)  # the RNG stream right after the checkpoint
    adapter = policy.adapter_state_dict()
    opt_state = state.optimizer.state_dict()
    lr = state.optimizer.param_groups[0]["lr"]

    fresh = make_policy("nvfp4")
    assert not all(torch.equal(v, adapter[k]) for k, v in fresh.adapter_state_dict().items())
    torch.rand(3)  # move the RNG on; resume must bring it back
    resumed = _start(fresh, root)
    assert torch.equal(torch.rand(5), next_draw)
    assert resumed.step == 2 and resumed.history == state.history and resumed.bad_steps_total == 1
    assert resumed.checkpoint_dir == str(saved)
    got = fresh.adapter_state_dict()
    assert got.keys() == adapter.keys() and all(helpers.bit_equal(got[k], adapter[k]) for k in adapter)
    new_opt = resumed.optimizer.state_dict()
    assert new_opt["param_groups"] == opt_state["param_groups"]
    assert new_opt["state"].keys() == opt_state["state"].keys()
    for i, s in opt_state["state"].items():
        assert all(torch.equal(new_opt["state"][i][k], v) for k, v in s.items())
    assert resumed.scheduler.last_epoch == state.scheduler.last_epoch == 2
    assert resumed.optimizer.param_groups[0]["lr"] == lr
    # the resumed optimizer continues exactly like the original one
    _train_a_little(policy, state, 1)
    _train_a_little(fresh, resumed, 1)
    after_a, after_b = policy.adapter_state_dict(), fresh.adapter_state_dict()
    assert all(torch.equal(after_a[k], after_b[k]) for k in after_a)


def test_start_run_does_not_resume_another_run(make_policy, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    policy = make_policy("nvfp4", lora_seed=11)
    state = _start(policy, root)
    state.step = 2
    state.history = [{"step": 2}]
    save_checkpoint(state, policy.adapter_state_dict(), root)
    saved = policy.adapter_state_dict()

    for fp, resume in (("fp2", "auto"), ("fp1", "never")):
        other = make_policy("nvfp4")
        before = other.adapter_state_dict()
        st = _start(other, root, fp=fp, resume=resume)
        assert st.step == 0 and st.history == [] and st.checkpoint_dir is None
        assert not st.optimizer.state and st.scheduler.last_epoch == 0
        now = other.adapter_state_dict()
        assert all(torch.equal(now[k], before[k]) for k in now)
        assert not all(torch.equal(now[k], saved[k]) for k in now)
