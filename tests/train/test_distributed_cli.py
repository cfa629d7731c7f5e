"""The real CLI under torchrun: ``torchrun --standalone --nproc_per_node=2 -m qerl run
--pipelines=qerl_train`` in a temporary copy of the project (2 CPU ranks, gloo, 2 steps, a tiny model):
one version of every output (rank 0's), step tables that hold the whole step in the global prompt
order, one console line per step, and a rerun of the finished run skipped on both ranks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]

LOCAL_PARAMS = """
data:
  sources:
    - {kind: reasoning_gym, name: chain_sum, size: 120, seed: 17,
       config: {min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2}}
  eval_size: 8
qerl:
  model: {path: MODEL}
  rollout: {group_size: 4, max_new_tokens: 8}
  rl: {steps: 2, prompts_per_step: 3, save_every: 2}
  report: {probe_size: 2, formats: [nvfp4], max_new_tokens: 4}
  eval: {k: 2, max_prompts: 4, max_new_tokens: 4}
"""


def _torchrun_kedro(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "1", "QERL_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "QERL_TRACKING": "off",
           "KEDRO_LOGGING_CONFIG": str(project / "conf" / "logging.yml")}
    env.pop("KEDRO_ENV", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "qerl", *args]
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def project(tiny_model_factory, tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("ddp_project")
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(ROOT / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(ROOT / "conf", dest / "conf", ignore=shutil.ignore_patterns("local"))
    (dest / "conf" / "local").mkdir()
    (dest / "conf" / "local" / "parameters.yml").write_text(LOCAL_PARAMS.replace("MODEL", str(tiny_model_factory())))
    (dest / "data").mkdir()
    return dest


def test_qerl_train_under_torchrun_writes_once_the_whole_step_and_skips_a_finished_run(project: Path) -> None:
    from qerl.train.generate import select_prompts

    out = _torchrun_kedro(project, "run", "--pipelines=qerl_train")
    logs = out.stdout + out.stderr
    assert "data parallel: 2 ranks (gloo)" in logs
    assert logs.count("step    1/2") == 1 and logs.count("step    2/2") == 1  # rank 0 logs, rank 1 does not
    reporting = project / "data" / "08_reporting"
    for name in ("training_metrics.parquet", "evaluation.csv", "noise_metrics.parquet", "training_plots"):
        assert len(list((reporting / name).iterdir())) == 1, name  # one version: rank 0's
    train_prompts = pd.read_parquet(next((project / "data" / "03_primary" / "train_prompts.parquet").glob("*/*")))
    for kind in ("rollouts", "scored_rollouts"):
        (run,) = (project / "data" / "07_model_output" / kind).glob("*/*")
        for step in (1, 2):
            (table,) = [pd.read_parquet(f) for f in (run / f"step_{step:06d}").glob("*.parquet")]
            expected = select_prompts(train_prompts, step, 3, 0)["id"].repeat(4).tolist()
            assert table["prompt_id"].tolist() == expected  # both ranks' shards, in the step's order
    metrics = pd.read_parquet(next((reporting / "training_metrics.parquet").glob("*/*")))
    assert metrics["step"].tolist() == [1, 2] and (metrics["reward/groups_kept"] == 3).all()
    assert (project / "data" / "06_models" / "checkpoints" / run.parent.name / run.name / "complete.json").exists()

    again = _torchrun_kedro(project, "run", "--pipelines=qerl_train")
    assert (again.stdout + again.stderr).count("is complete") == 1 and "step    1/2" not in again.stdout
    assert len(list((reporting / "training_metrics.parquet").iterdir())) == 1
