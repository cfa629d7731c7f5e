"""The plain (Kedro-free) training loop runs the same stages end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch

from qerl.rl.objective import ObjectiveConfig
from qerl.train.loop import LoopConfig, train
from qerl.train.steps import RolloutConfig


def test_loop_trains_checkpoints_and_records_each_step(tiny_model_dir: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    prompts = pd.DataFrame(
        {"id": [f"p{i}" for i in range(4)], "prompt": [f"{i} + 1 =" for i in range(4)],
         "answer": [str(i + 1) for i in range(4)], "task": "add", "metadata": json.dumps({})}
    )
    cfg = LoopConfig(
        model_path=str(tiny_model_dir), format="nvfp4", steps=3, prompts_per_step=2, save_every=2,
        rollout=RolloutConfig(group_size=2, max_new_tokens=4),
        objective=ObjectiveConfig(loss_type="dapo", max_completion_length=4),
        rewards=[{"name": "exact_match"}, {"name": "format"}], checkpoint_root=str(tmp_path), engine="hf",
    )
    policy, state = train(cfg, prompts)
    assert state.step == 3 and [h["step"] for h in state.history] == [1, 2, 3]
    assert all(h["reward_mean"] == h["reward_mean"] for h in state.history)  # finite, recorded
    ckpts = sorted(p.name for p in tmp_path.glob("loop/*/step_*"))
    assert ckpts == ["step_000002", "step_000003"]
    # LoRA B starts at zero: a real update makes it non-zero
    assert any(float(p.abs().sum()) > 0 for n, p in policy.model.named_parameters() if "lora_B" in n)
