"""Runs on disk: the LR schedule, checkpoints in peft's format, the run fingerprint, resume (also
after corruption), seeded reproducibility, and single-node replays, through the Kedro-free loop."""

from __future__ import annotations

import errno
import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from qerl.errors import QerlConfigError
from qerl.params import TrainParams
from qerl.train import checkpoints as ck
from qerl.train.checkpoints import CheckpointStore, fingerprint, run_identity
from qerl.train.loop import replay_state, start_run, train
from qerl.train.policy import build_policy_for
from qerl.train.state import build_scheduler

_EVIL_RAN: list[str] = []


def _evil() -> str:
    _EVIL_RAN.append("ran")
    return "pwned"


class Evil:
    """Unpickling this runs code: a weights_only load must refuse it."""

    def __reduce__(self):
        return (_evil, ())


def _lrs(total: int, warmup_ratio: float, kind: str) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=2.0)
    sched = build_scheduler(opt, total, warmup_ratio, kind)
    lrs = [opt.param_groups[0]["lr"]]
    for _ in range(total):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def test_scheduler_warmup_then_cosine_and_constant() -> None:
    lrs = _lrs(10, 0.2, "cosine")
    expected = [2.0 * 0.5, 2.0 * 1.0] + [2.0 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(9)]
    assert lrs == pytest.approx(expected, abs=1e-12)
    assert _lrs(8, 0.25, "constant") == pytest.approx([1.0, 2.0] + [2.0] * 7)


# ------------------------------------------------------------------ fixtures


@pytest.fixture
def prompts() -> pd.DataFrame:
    return pd.DataFrame({"id": [f"p{i}" for i in range(6)], "prompt": [f"{i} + 1 =" for i in range(6)],
                         "answer": [str(i + 1) for i in range(6)], "task": "add", "metadata": "{}"})


@pytest.fixture
def params(tiny_model_dir: Path) -> TrainParams:
    return TrainParams(
        model={"path": str(tiny_model_dir), "device": "cpu"}, lora={"r": 4, "alpha": 8},
        rollout={"group_size": 2, "max_new_tokens": 4, "engine": "hf"},
        rewards={"functions": [{"name": "exact_match"}, {"name": "format"}]},
        rl={"steps": 4, "prompts_per_step": 2, "save_every": 2, "lr": 1e-2, "run_name": "t"},
        noise={"schedule": "linear", "sigma_start": 1e-2, "sigma_end": 1e-3, "stages": 3},
    )


def _adapter(policy) -> dict[str, torch.Tensor]:
    return policy.adapter_state_dict()


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ the run directory


def test_checkpoint_layout_is_peft_plus_our_state_and_loads_with_peft(params, prompts, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy, state = train(params.with_updates(quant={"format": "none"}), prompts, checkpoint_root=str(tmp_path))
    run = state.run
    assert run.checkpoint_steps() == [2, 4] and run.is_complete() is False  # complete is the pipeline's last node
    step4 = run.path / "step_000004"
    names = {p.name for p in step4.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "qerl_state.json", "qerl_optimizer.pt"} <= names
    assert "trainer_state.json" not in names  # no collision with transformers' file of that name
    assert (run.path / "run.json").exists() and json.loads((run.path / "run.json").read_text())["settings"]["rl"]["steps"] == 4
    assert run.adapter_steps() == [0, 1, 2, 3, 4]
    assert not list(run.path.rglob(".partial-*"))
    # plain peft loads the checkpoint onto the base and gives the policy's logits
    base = AutoModelForCausalLM.from_pretrained(params.model.path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(step4)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, policy.model(input_ids=ids).logits, atol=1e-5, rtol=0)
    meta = json.loads((step4 / "qerl_state.json").read_text())
    assert meta["step"] == 4 and [h["step"] for h in meta["history"]] == [1, 2, 3, 4]


def test_fingerprint_covers_the_training_path_only(params, prompts) -> None:
    fp = fingerprint(run_identity(params, prompts))
    assert fp == fingerprint(run_identity(params, prompts.copy())) and len(fp) == 10
    same = [params.with_updates(rl={"save_every": 3}), params.with_updates(eval={"k": 2}),
            params.with_updates(report={"probe_size": 2}), params.with_updates(model={"device": "auto"})]
    assert all(fingerprint(run_identity(p, prompts)) == fp for p in same)
    changed = [params.with_updates(rl={"lr": 2e-2}), params.with_updates(quant={"format": "mxfp4"}),
               params.with_updates(rollout={"temperature": 0.9})]
    assert all(fingerprint(run_identity(p, prompts)) != fp for p in changed)
    other_data = prompts.assign(prompt=prompts["prompt"].str.replace("+", "-"))
    assert fingerprint(run_identity(params, other_data)) != fp  # the data block is part of the run


def test_failed_checkpoint_write_keeps_the_previous_one_and_says_disk_full(params, prompts, tmp_path: Path,
                                                                           monkeypatch) -> None:
    policy, state = train(params.with_updates(rl={"steps": 2}), prompts, checkpoint_root=str(tmp_path))
    real_save = torch.save

    def full_disk(obj, f, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ck.torch, "save", full_disk)
    state.step = 4
    with pytest.raises(QerlConfigError, match="no space left on the device"):
        state.run.save_checkpoint(policy, state.meta(), state.optim_state())
    monkeypatch.setattr(ck.torch, "save", real_save)
    assert state.run.checkpoint_steps() == [2] and not list(state.run.path.rglob(".partial-*"))


def test_resume_never_unpickles_and_falls_back_past_a_corrupt_checkpoint(params, prompts, tmp_path: Path, caplog) -> None:
    policy, state = train(params, prompts, checkpoint_root=str(tmp_path))
    run = state.run
    torch.save({"optimizer": Evil(), "scheduler": None}, run.path / "step_000004" / "qerl_optimizer.pt")
    with pytest.raises(QerlConfigError, match="did not write"):
        run.load_checkpoint(4)
    assert _EVIL_RAN == []
    (run.path / "step_000002" / "adapter_model.safetensors").write_bytes(b"garbage")
    with caplog.at_level("WARNING"):
        assert run.latest_good_checkpoint() is None
    assert "step 4 is unusable" in caplog.text and "step 2 is unusable" in caplog.text
    # a fresh checkpoint at step 2 again: the newest (step 4) is corrupt, resume takes step 2
    p2, s2 = train(params.with_updates(rl={"steps": 2}), prompts, checkpoint_root=str(tmp_path / "b"))
    good = s2.run
    torch.save({"optimizer": Evil(), "scheduler": None}, good.path / "step_000002" / "qerl_optimizer.pt")
    s2.step = 1
    s2.run.save_checkpoint(p2, {**s2.meta(), "step": 1}, s2.optim_state())
    fresh, _ = build_policy_for(params.with_updates(rl={"steps": 2}))
    resumed = start_run(fresh, params.with_updates(rl={"steps": 2}), prompts, CheckpointStore(tmp_path / "b"))
    assert resumed.step == 1


def test_two_fresh_runs_with_one_seed_end_bitwise_equal_and_another_seed_differs(params, prompts, tmp_path: Path) -> None:
    torch.manual_seed(123)  # the global RNG must not matter
    a, _ = train(params, prompts, checkpoint_root=str(tmp_path / "a"))
    torch.manual_seed(999)
    b, _ = train(params, prompts, checkpoint_root=str(tmp_path / "b"))
    assert _equal(_adapter(a), _adapter(b))
    c, _ = train(params.with_updates(rl={"seed": 1}), prompts, checkpoint_root=str(tmp_path / "c"))
    assert not _equal(_adapter(a), _adapter(c))


def test_a_run_killed_after_a_checkpoint_resumes_to_the_uninterrupted_result(params, prompts, tmp_path: Path) -> None:
    whole, whole_state = train(params, prompts, checkpoint_root=str(tmp_path / "whole"))

    class Killed(Exception):
        pass

    def kill_after_3(row: dict) -> None:
        if row["step"] == 3:
            raise Killed

    with pytest.raises(Killed):
        train(params, prompts, checkpoint_root=str(tmp_path / "killed"), on_step=kill_after_3)
    resumed, state = train(params, prompts, checkpoint_root=str(tmp_path / "killed"))  # resumes from step 2
    assert state.first_step == 2 and state.step == 4
    assert _equal(_adapter(resumed), _adapter(whole))
    assert [h["step"] for h in state.history] == [1, 2, 3, 4]
    cols = ["reward/mean", "rollout/entropy", "train/loss"]
    assert [[h[c] for c in cols] for h in state.history] == [[h[c] for c in cols] for h in whole_state.history]


def test_another_configuration_or_resume_never_starts_over(params, prompts, tmp_path: Path, caplog) -> None:
    train(params, prompts, checkpoint_root=str(tmp_path))
    store = CheckpointStore(tmp_path)
    other = params.with_updates(rl={"lr": 5e-3})
    with caplog.at_level("INFO", logger="qerl.train.loop"):
        st = start_run(build_policy_for(other)[0], other, prompts, store)
    assert st.step == 0 and "differs in qerl.rl.lr" in caplog.text
    st = start_run(build_policy_for(params)[0], params, prompts, store)
    assert st.step == 4  # the same configuration resumes (here: its last checkpoint)
    never = params.with_updates(rl={"resume": "never"})
    st = start_run(build_policy_for(never)[0], never, prompts, store)
    assert st.step == 0 and st.run.checkpoint_steps() == []
    assert len(list((tmp_path / "t").glob(f"{st.fingerprint}.replaced-*"))) == 1  # the old run moved aside


def test_replay_uses_the_adapter_that_produced_the_step(params, prompts, tmp_path: Path) -> None:
    from qerl.train.loop import finish_step, generate
    from qerl.train.score import score_step
    from qerl.train.update import update_step

    store = CheckpointStore(tmp_path)
    policy, _ = build_policy_for(params)
    state = start_run(policy, params, prompts, store)
    tables: dict[int, pd.DataFrame] = {}
    while not state.done:  # the loop of run_step, keeping each step's rollouts
        table = generate(policy, state, prompts, params.rollout, params.rl)
        tables[int(table["step"].iloc[0])] = table
        finish_step(policy, state, update_step(policy, state, score_step(table, params.rewards, params.rl), params.rl,
                                               params.rollout))
    fresh, _ = build_policy_for(params)
    replay = replay_state(fresh, params, prompts, store, 3)
    assert replay.replay_step == 3 and not replay.resident and replay.step == 2
    assert _equal(_adapter(fresh), state.run.adapter_after(2))
    again = generate(fresh, replay, prompts, params.rollout, params.rl)
    assert (again["step"] == 3).all() and again["replay"].all() and not tables[3]["replay"].any()
    assert list(again["completion"]) == list(tables[3]["completion"])
    assert [list(x) for x in again["logprobs"]] == [list(x) for x in tables[3]["logprobs"]]
    assert replay_state(fresh, params, prompts, store, None).replay_step == 4  # default: the last step
    with pytest.raises(QerlConfigError, match="replay.step"):
        replay_state(fresh, params, prompts, store, 9)
    with pytest.raises(QerlConfigError, match="no run of this configuration"):
        replay_state(fresh, params.with_updates(rl={"lr": 0.5}), prompts, store, 1)
    mx, _ = build_policy_for(params.with_updates(quant={"format": "mxfp4"}))
    with pytest.raises(QerlConfigError, match="differs from the one run"):
        replay_state(mx, params, prompts, store, 1)
