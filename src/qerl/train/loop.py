"""The whole QeRL loop without Kedro, readable top to bottom.

    from qerl.train.loop import LoopConfig, train
    policy, state = train(LoopConfig(model_path="data/06_models/embedded_model"), train_prompts)

``train_prompts`` is a prompt table (``qerl.data.schema``), e.g. from
``qerl.data.sources.build_prompt_tables``. The Kedro pipeline ``qerl_train`` runs exactly these
calls, one node per stage and step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from qerl.noise.schedules import NoiseConfig, build_schedule
from qerl.rewards.base import build_rewards
from qerl.rl.objective import ObjectiveConfig
from qerl.rollout import get_engine
from qerl.train.policy import Policy, PolicySpec, build_policy
from qerl.train.run import finish_step, start_run
from qerl.train.state import TrainState, fingerprint
from qerl.train.steps import (
    RolloutConfig,
    UpdateConfig,
    rollout_step,
    score_step,
    select_prompts,
    update_step,
)


@dataclass
class LoopConfig:
    """A compact version of the ``qerl`` parameter block."""

    model_path: str
    format: str = "nvfp4"
    lora: dict[str, Any] = field(default_factory=dict)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    rewards: list[dict[str, Any]] = field(default_factory=lambda: [{"name": "reasoning_gym"}, {"name": "format", "kwargs": {"reward": 0.1}}])
    steps: int = 40
    prompts_per_step: int = 16
    lr: float = 2e-3
    warmup_ratio: float = 0.05
    max_grad_norm: float = 1.0
    engine: str = "auto"
    run_name: str = "loop"
    save_every: int = 10
    checkpoint_root: str = "data/06_models/checkpoints"
    seed: int = 0


def train(cfg: LoopConfig, train_prompts: pd.DataFrame) -> tuple[Policy, TrainState]:
    """Build the 4-bit LoRA policy, then for each step: rollouts -> rewards -> update."""
    policy, _ = build_policy(PolicySpec(model_path=cfg.model_path, format=cfg.format, lora=cfg.lora))
    rewards = build_rewards(cfg.rewards)
    engine = get_engine(cfg.engine, policy.device)
    state = start_run(
        policy, run_name=cfg.run_name, fingerprint=fingerprint({"cfg": repr(cfg)}), total_steps=cfg.steps,
        save_every=cfg.save_every, optimizer="adamw", lr=cfg.lr, weight_decay=0.0, warmup_ratio=cfg.warmup_ratio,
        lr_schedule="cosine", optimizer_steps_per_step=1, noise=build_schedule(cfg.noise, cfg.steps),
        checkpoint_root=cfg.checkpoint_root,
    )
    update = UpdateConfig(objective=cfg.objective, max_grad_norm=cfg.max_grad_norm, seed=cfg.seed)
    for step in range(state.step + 1, cfg.steps + 1):
        prompts = select_prompts(train_prompts, step, cfg.prompts_per_step, cfg.seed)
        sigma = state.noise.sigma(step - 1)  # AQN: stage 0 noise-free, then decaying
        rollouts = rollout_step(policy, prompts, step, sigma, cfg.rollout, engine, cfg.seed)
        scored = score_step(rollouts, rewards, cfg.rollout.group_size)
        metrics = update_step(policy, state, scored, update, cfg.rollout.temperature)
        finish_step(policy, state, metrics, cfg.checkpoint_root)
    return policy, state
