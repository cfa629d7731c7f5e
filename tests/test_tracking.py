"""MLflow tracking (the ``mlflow`` extra, part of ``.[dev]``): the switch and the helpers of
``qerl.tracking``, and the real CLI in a temporary project copy: a refused run creates no store, and a
short qerl_train with tracking on is read back through MLflow's own client (per-step metrics at the
RL step, flattened params, the tables, plots and the peft adapter as artifacts). Tiny settings, CPU."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from qerl import tracking
from qerl.params import TrainParams

ROOT = Path(__file__).resolve().parents[1]
KEDRO = str(Path(sys.executable).with_name("kedro"))


# ------------------------------------------------------------------------------ switch and helpers


def test_switch_off_or_extra_missing_registers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QERL_TRACKING", "off")
    assert tracking.tracking_hooks() == ()
    monkeypatch.setenv("QERL_TRACKING", "on")
    monkeypatch.setitem(sys.modules, "kedro_mlflow", None)  # as if the extra were not installed
    assert not tracking.tracking_available() and tracking.tracking_hooks() == ()


def test_switch_on_with_the_extra_registers_the_wrapped_plugin_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("kedro_mlflow")
    monkeypatch.delenv("QERL_TRACKING", raising=False)
    hooks = tracking.tracking_hooks()
    assert [type(h).__name__ for h in hooks] == ["MlflowTracking"]
    assert type(hooks[0]._plugin).__module__ == "kedro_mlflow.framework.hooks.mlflow_hook"


def test_under_torchrun_only_rank_zero_tracks(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("kedro_mlflow")
    monkeypatch.delenv("QERL_TRACKING", raising=False)
    monkeypatch.setenv("RANK", "1")
    assert tracking.tracking_hooks() == ()
    monkeypatch.setenv("RANK", "0")
    assert [type(h).__name__ for h in tracking.tracking_hooks()] == ["MlflowTracking"]


def test_params_are_the_validated_blocks_flattened() -> None:
    flat = tracking.flat_params({"qerl": TrainParams(rl={"lr": 2e-3}, lora={"target_modules": ["q_proj"]})})
    assert flat["qerl.rl.lr"] == "0.002" and flat["qerl.quant.format"] == "nvfp4"
    assert flat["qerl.lora.target_modules"] == '["q_proj"]' and flat["qerl.rl.micro_batch_tokens"] == "null"
    assert flat["qerl.noise.controller.window"] == "10"  # nested sub-models flattened all the way
    assert "qerl.rl" not in flat and not any("=" in v for k, v in flat.items() if k != "qerl.rewards.functions")


def test_used_blocks_are_the_ones_the_pipeline_reads() -> None:
    blocks = tracking.used_blocks(["params:qerl.rl", "params:data", "train_prompts"],
                                  {"qerl": {"rl": {"steps": 3}}, "data": {}, "quant_study": {}})
    assert sorted(blocks) == ["data", "qerl"] and blocks["qerl"].rl.steps == 3


def test_metrics_keep_numbers_under_names_mlflow_accepts() -> None:
    row = {"step": 3, "reward/mean": 0.5, "rollout/tokens": 12, "noise/state": {"sigma": 1.0}, "train/skipped": True,
           "pass@1_greedy": 1, "stage": "after"}
    assert tracking.numeric_metrics(row, prefix="x/") == {"x/reward/mean": 0.5, "x/rollout/tokens": 12.0,
                                                          "x/pass_at_1_greedy": 1.0}


# ------------------------------------------------------------------------------ the real CLI


LOCAL = {
    "parameters_data_prep.yml": """
data:
  sources:
    - {kind: reasoning_gym, name: chain_sum, size: 40, seed: 17,
       config: {min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2}}
  eval_size: 6
""",
    "parameters_qerl_train.yml": """
qerl:
  model: {path: MODEL}
  rollout: {group_size: 2, max_new_tokens: 6}
  rl: {steps: 3, prompts_per_step: 2, save_every: 2, lr: 2.0e-3}
  report: {probe_size: 2, formats: [nvfp4], max_new_tokens: 4}
  eval: {k: 2, max_prompts: 4, max_new_tokens: 6}
""",
}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KEDRO_ENV", "QERL_TRACKING", "MLFLOW_TRACKING_URI")}
    env.update(KEDRO_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               KEDRO_LOGGING_CONFIG=str(ROOT / "conf" / "logging.yml"), QERL_NUM_THREADS="2", **extra)
    return env


def _kedro(project: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KEDRO, *args], cwd=project, env=_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    pytest.importorskip("kedro_mlflow")
    dest = tmp_path_factory.mktemp("tracked_project")
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(ROOT / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(ROOT / "conf", dest / "conf", ignore=shutil.ignore_patterns("local"))
    (dest / "conf" / "local").mkdir()
    for name, text in LOCAL.items():
        (dest / "conf" / "local" / name).write_text(text.replace("MODEL", str(tiny_model_dir)))
    (dest / "data").mkdir()
    return dest


def _newest(path: Path) -> Path:
    return path / sorted(p.name for p in path.iterdir())[-1] / path.name


@pytest.mark.slow
def test_a_refused_run_creates_no_tracking_store(project: Path) -> None:
    proc = _kedro(project, "run", "--pipelines=qerl_train", "--params", "qerl.rl.steps=abc")
    assert proc.returncode == 2 and "qerl.rl.steps" in proc.stderr
    assert not (project / "data" / "09_tracking").exists()


@pytest.mark.slow
def test_qerl_train_is_tracked_and_reads_back_through_mlflow(project: Path, tiny_model_dir: Path) -> None:
    from mlflow.artifacts import download_artifacts
    from mlflow.tracking import MlflowClient

    proc = _kedro(project, "run", "--pipelines=qerl_train")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tracking: MLflow run" in proc.stdout and "type hints" not in proc.stdout + proc.stderr  # mlflow's import note
    client = MlflowClient(tracking_uri=f"sqlite:///{project / 'data' / '09_tracking' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("qerl")
    (run,) = client.search_runs([experiment.experiment_id])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"

    rep = project / "data" / "08_reporting"
    metrics = pd.read_parquet(_newest(rep / "training_metrics.parquet"))
    assert run.data.tags["qerl.run"] == metrics["run"].iloc[0]
    for name in ("reward/mean", "rollout/entropy", "train/loss"):
        history = client.get_metric_history(run_id, name)
        assert [m.step for m in history] == [1, 2, 3], name
        assert [m.value for m in history] == pytest.approx(metrics[name].tolist()), name
    assert [m.step for m in client.get_metric_history(run_id, "eval/pass_at_1_greedy")] == [0, 3]

    params = run.data.params
    assert params["qerl.rl.lr"] == "0.002" and params["qerl.rl.steps"] == "3" and params["data.eval_size"] == "6"
    assert params["qerl.model.path"] == str(tiny_model_dir) and "qerl.rl" not in params and "qerl" not in params

    artifacts = Path(download_artifacts(artifact_uri=run.info.artifact_uri, dst_path=str(project / "downloaded")))
    pd.testing.assert_frame_equal(pd.read_csv(artifacts / "tables" / "evaluation.csv"),
                                  pd.read_csv(_newest(rep / "evaluation.csv")))
    assert {"reward_mean.png", "evaluation.png"} <= {p.name for p in (artifacts / "plots").iterdir()}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in (artifacts / "plots").iterdir())
    assert json.loads((artifacts / "run.json").read_text())["settings"]["rl"]["lr"] == 0.002

    # the adapter is the final checkpoint's, in peft's format: plain peft loads it onto the base
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    final = project / "data" / "06_models" / "checkpoints" / metrics["run"].iloc[0] / "step_000003"
    ours, logged = load_file(str(final / "adapter_model.safetensors")), load_file(str(artifacts / "adapter" / "adapter_model.safetensors"))
    assert ours.keys() == logged.keys() and all((ours[k] == logged[k]).all() for k in ours)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(artifacts / "adapter"))
    loaded = dict(model.named_parameters())
    assert all((loaded[k.replace(".weight", ".default.weight")].detach() == ours[k]).all() for k in ours)
