"""The real CLI in a temporary copy of the project: embedded model -> qerl_train -> single-node
rerun -> SIGKILL + resume -> the analysis notebook. Tiny settings, CPU only."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
KEDRO = str(Path(sys.executable).with_name("kedro"))

LOCAL_PARAMS = {
    "parameters_data_prep.yml": """
data:
  sources:
    - {kind: reasoning_gym, name: chain_sum, size: 240, seed: 17,
       config: {min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2}}
  eval_size: 16
""",
    "parameters_embedded_model.yml": """
embedded_model:
  spec: {hidden_size: 64, num_hidden_layers: 1, num_attention_heads: 2, num_key_value_heads: 2, intermediate_size: 128}
  sft: {steps: 12, batch_size: 16, target_accuracy: null}
  sft_size: 200
""",
    "parameters_qerl_train.yml": """
qerl:
  rollout: {group_size: 4, max_new_tokens: 10}
  rl: {steps: 4, prompts_per_step: 3, save_every: 2}
  report: {probe_size: 4, formats: [nvfp4, mxfp4], max_new_tokens: 8}
  eval: {k: 2, max_prompts: 6, max_new_tokens: 10}
""",
    "parameters_quant_study.yml": """
quant_study:
  seeds: [0, 1]
  steps: 2
  probe_size: 4
  eval_max_prompts: 4
  eval_k: 2
  variants:
    - {name: none_param_noise, format: none, noise: none, lr_scale: 0.5, param_noise: nvfp4}
    - {name: nvfp4_aqn, format: nvfp4, noise: exponential}
    - {name: nvfp4_entropy_ctrl, format: nvfp4, noise: entropy_feedback}
""",
}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        KEDRO_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        KEDRO_LOGGING_CONFIG=str(ROOT / "conf" / "logging.yml"), QERL_NUM_THREADS="2", PYTHONUNBUFFERED="1",
    )
    env.pop("KEDRO_ENV", None)
    return env


def kedro(project: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([KEDRO, *args], cwd=project, env=_env(), capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"kedro {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def make_project(dest: Path) -> Path:
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    shutil.copytree(ROOT / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(ROOT / "conf", dest / "conf", ignore=shutil.ignore_patterns("local"))
    shutil.copytree(ROOT / "notebooks", dest / "notebooks")
    (dest / "conf" / "local").mkdir()
    for name, text in LOCAL_PARAMS.items():
        (dest / "conf" / "local" / name).write_text(text)
    (dest / "data").mkdir()
    return dest


def versions(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_project(tmp_path_factory.mktemp("qerl_project"))


def test_registry_lists_pipelines(project: Path) -> None:
    out = kedro(project, "registry", "list").stdout
    for name in ("data_prep", "embedded_model", "quant_setup", "qerl_train"):
        assert f"- {name}" in out


def test_bad_format_refused_before_anything_is_written(project: Path) -> None:
    proc = kedro(project, "run", "--pipeline=qerl_train", "--params", "qerl.quant.format=int3", check=False)
    assert proc.returncode != 0
    assert "quant.format" in proc.stdout + proc.stderr
    assert not (project / "data" / "06_models").exists() and not (project / "data" / "03_primary").exists()


def test_train_end_to_end(project: Path) -> None:
    kedro(project, "run", "--pipeline=embedded_model")
    model_dir = project / "data" / "06_models" / "embedded_model"
    assert (model_dir / "model.safetensors").exists() and (model_dir / "tokenizer.json").exists()
    acc_dir = project / "data" / "08_reporting" / "embedded_model_accuracy.csv"
    acc = pd.read_csv(acc_dir / versions(acc_dir)[-1] / acc_dir.name)
    assert 0.0 <= acc.loc[0, "greedy_accuracy"] <= 1.0 and acc.loc[0, "n_eval"] == 16

    run = kedro(project, "run", "--pipeline=qerl_train")
    assert "step    4/4" in run.stdout
    rep = project / "data" / "08_reporting"
    metrics = pd.read_parquet(next((rep / "training_metrics.parquet").glob("*/training_metrics.parquet")))
    assert metrics["step"].tolist() == [1, 2, 3, 4]
    for col in ("reward_mean", "entropy", "sigma", "loss", "grad_norm", "lr", "logprob_gap_mean", "tokens_per_s", "kl_to_base"):
        assert metrics[col].notna().all(), col
    evaluation = pd.read_csv(next((rep / "evaluation.csv").glob("*/evaluation.csv")))
    assert evaluation["stage"].tolist() == ["before", "after"] and evaluation["n_prompts"].tolist() == [6, 6]
    noise = pd.read_parquet(next((rep / "noise_metrics.parquet").glob("*/noise_metrics.parquet")))
    assert set(noise["format"]) == {"nvfp4", "mxfp4"}
    assert (noise["kl"] >= 0).all() and "trained policy (adapter on)" in set(noise["variant"])
    pngs = list((rep / "training_plots").glob("*/training_plots/*.png"))
    assert {p.name for p in pngs} >= {"reward_mean.png", "entropy.png", "sigma.png", "kl_to_base.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    for k in range(1, 5):
        table = next((project / "data" / "07_model_output" / "scored_rollouts" / f"step_{k:04d}.parquet").glob("*/*.parquet"))
        df = pd.read_parquet(table)
        assert len(df) == 3 * 4 and (df["step"] == k).all()
    ckpts = sorted(p.name for p in (project / "data" / "06_models" / "checkpoints" / "embedded").glob("*/step_*"))
    assert ckpts == ["step_000002", "step_000004"]


def test_rerun_rollout_node_alone(project: Path) -> None:
    rollouts = project / "data" / "07_model_output" / "rollouts" / "step_0003.parquet"
    before = versions(rollouts)
    out = kedro(project, "run", "--pipeline=qerl_train", "--nodes=step_0003.generate_rollouts")
    assert "from checkpoint" in out.stdout
    after = versions(rollouts)
    assert len(after) == len(before) + 1
    df = pd.read_parquet(rollouts / after[-1] / rollouts.name)
    assert len(df) == 12 and (df["step"] == 3).all()


def test_kill_and_resume(project: Path) -> None:
    args = ["run", "--pipeline=qerl_train", "--params", "qerl.rl.steps=8,qerl.rl.run_name=killed,qerl.rl.save_every=2"]
    ckpt_root = project / "data" / "06_models" / "checkpoints" / "killed"
    proc = subprocess.Popen([KEDRO, *args], cwd=project, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not list(ckpt_root.glob("*/step_000002/trainer_state.json")):
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(p.name for p in ckpt_root.glob("*/step_*") if (p / "trainer_state.json").exists())
    assert done and done[-1] != "step_000008"

    rep = project / "data" / "08_reporting" / "training_metrics.parquet"
    n_versions = len(versions(rep))
    out = kedro(project, *args).stdout
    resumed_from = int(done[-1].split("_")[1])
    assert f"from step {resumed_from}" in out
    latest = versions(rep)
    assert len(latest) == n_versions + 1
    metrics = pd.read_parquet(rep / latest[-1] / rep.name)
    assert metrics["step"].tolist() == list(range(1, 9))  # every step exactly once


def test_quant_study(project: Path) -> None:
    kedro(project, "run", "--pipeline=quant_study")
    rep = project / "data" / "08_reporting"
    summary = pd.read_csv(next((rep / "quant_study_summary.csv").glob("*/*.csv")))
    assert summary["variant"].tolist() == ["none_param_noise", "nvfp4_aqn", "nvfp4_entropy_ctrl"]
    assert (summary["seeds"] == 2).all()
    runs = pd.read_csv(next((rep / "quant_study_runs.csv").glob("*/*.csv")))
    assert len(runs) == 6 and runs["pass@1_after"].between(0, 1).all()
    # the parameter-noise control really perturbs the full-precision base; nvfp4 is 4-bit
    kl = runs.groupby("variant")["kl_to_full_precision"].mean()
    assert (kl > 0).all()
    metrics = pd.read_parquet(next((rep / "quant_study_metrics.parquet").glob("*/*.parquet")))
    assert metrics.groupby(["variant", "seed"])["step"].apply(list).map(lambda s: s == [1, 2]).all()
    pngs = {p.name for p in (rep / "quant_study_plots").glob("*/*/*.png")}
    assert pngs == {"reward.png", "entropy.png", "final_pass1.png"}


def test_notebook_runs_on_catalog_outputs(project: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.read(project / "notebooks" / "qerl_analysis.ipynb", as_version=4)
    os.environ["QERL_PROJECT_PATH"] = str(project)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(project)}}).execute()
    finally:
        os.environ.pop("QERL_PROJECT_PATH", None)
    texts = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert any("completions over" in t for t in texts)
    assert any("none_param_noise" in t for t in texts)  # the study section read quant_study_summary


def test_missing_checkpoint_names_the_pipeline(tmp_path: Path) -> None:
    fresh = make_project(tmp_path)
    proc = kedro(fresh, "run", "--pipeline=qerl_train", "--nodes=step_0001.generate_rollouts", check=False)
    assert proc.returncode != 0
    assert "kedro run --pipeline=qerl_train" in proc.stdout + proc.stderr
