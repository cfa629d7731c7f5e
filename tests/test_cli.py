"""The real CLI in a temporary copy of the project: refusals, embedded model -> qerl_train, a rerun of
the finished run (skipped), a replay of one step, SIGKILL / SIGTERM and kills inside writes with
resume, the quantization study, a replay after it, and the analysis notebook. Tiny settings, CPU."""

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
        QERL_TRACKING="off",  # MLflow tracking is tests/test_tracking.py's; off, these stay fast
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


def all_versions(project: Path) -> dict[str, list[str]]:
    """Every versioned output (and step table) under data/, for 'nothing new was written' checks."""
    out = {}
    for p in (project / "data").rglob("*"):
        if p.is_file() and "06_models" not in p.parts:
            out.setdefault(str(p.parent.relative_to(project)), []).append(p.name)
    return out


def newest(path: Path) -> Path:
    return path / versions(path)[-1] / path.name


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_project(tmp_path_factory.mktemp("qerl_project"))


def test_registry_lists_pipelines_and_qerl_is_the_kedro_cli(project: Path) -> None:
    out = kedro(project, "registry", "list").stdout
    for name in ("data_prep", "embedded_model", "quant_setup", "qerl_train", "quant_study"):
        assert f"- {name}" in out
    qerl = subprocess.run([str(Path(sys.executable).with_name("qerl")), "registry", "list"], cwd=project, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert qerl.returncode == 0 and "- qerl_train" in qerl.stdout


@pytest.mark.parametrize("args,needle", [
    (["--params", "qerl.quant.format=int3"], "qerl.quant.format: Input should be"),
    (["--params", "qerl.rl.steps=abc"], "qerl.rl.steps: Input should be a valid integer"),
    (["--params", "qerll.rl.steps=5"], "did you mean qerl?"),
    (["--pipelines=qerl_trian"], "did you mean qerl_train?"),
])
def test_refusals_are_one_line_and_write_nothing(project: Path, args: list[str], needle: str) -> None:
    cmd = ["run", *args] if args[0].startswith("--pipelines") else ["run", "--pipelines=qerl_train", *args]
    proc = kedro(project, *cmd, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert needle in proc.stderr and "Fix:" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "Traceback" in (project / "data" / "09_logs" / "last_error.log").read_text()
    assert not (project / "data" / "06_models").exists() and not (project / "data" / "03_primary").exists()


def test_train_end_to_end(project: Path) -> None:
    built = kedro(project, "run", "--pipelines=embedded_model")
    assert "Completed node" not in built.stdout + built.stderr  # Kedro's per-node lines are dropped
    model_dir = project / "data" / "06_models" / "embedded_model"
    assert (model_dir / "model.safetensors").exists() and (model_dir / "tokenizer.json").exists()
    acc = pd.read_csv(newest(project / "data" / "08_reporting" / "embedded_model_accuracy.csv"))
    assert 0.0 <= acc.loc[0, "greedy_accuracy"] <= 1.0 and acc.loc[0, "n_eval"] == 16

    run = kedro(project, "run", "--pipelines=qerl_train")
    log = run.stdout + run.stderr
    assert "step    4/4 | reward" in log and "eta " in log
    assert "finished: held-out greedy pass@1" in log and "Completed 1 out of" not in log  # one line per step
    rep = project / "data" / "08_reporting"
    metrics = pd.read_parquet(newest(rep / "training_metrics.parquet"))
    assert metrics["step"].tolist() == [1, 2, 3, 4] and metrics["run"].nunique() == 1
    for col in ("reward/mean", "rollout/entropy", "train/entropy", "noise/sigma", "train/loss", "train/grad_norm",
                "train/lr", "mismatch/logprob_gap_mean", "mismatch/kl", "mismatch/is_weight_mean",
                "rollout/tokens_per_s", "train/kl_to_base", "memory/peak_gib"):
        assert metrics[col].notna().all(), col
    evaluation = pd.read_csv(newest(rep / "evaluation.csv"))
    assert evaluation["stage"].tolist() == ["before", "after"] and evaluation["n_prompts"].tolist() == [6, 6]
    noise = pd.read_parquet(newest(rep / "noise_metrics.parquet"))
    assert set(noise["format"]) == {"nvfp4", "mxfp4"} and "trained policy (adapter on)" in set(noise["variant"])
    pngs = list((rep / "training_plots").glob("*/training_plots/*.png"))
    assert {p.name for p in pngs} >= {"reward_mean.png", "rollout_entropy.png", "evaluation.png", "overview.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)
    run_key = metrics["run"].iloc[0]
    for k in range(1, 5):
        tables = list((project / "data" / "07_model_output" / "scored_rollouts" / run_key / f"step_{k:06d}").glob("*.parquet"))
        assert len(tables) == 1
        df = pd.read_parquet(tables[0])
        assert len(df) == 3 * 4 and (df["step"] == k).all() and not df["replay"].any()
    run_dir = project / "data" / "06_models" / "checkpoints" / run_key
    assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_000002", "step_000004"]
    assert (run_dir / "step_000004" / "adapter_config.json").exists() and (run_dir / "complete.json").exists()
    assert not (project / "data" / "09_tracking").exists()  # QERL_TRACKING=off: no MLflow store


def test_rerun_of_a_finished_run_is_a_no_op(project: Path) -> None:
    before = all_versions(project)
    out = kedro(project, "run", "--pipelines=qerl_train")
    assert "is complete" in out.stdout + out.stderr and "skipped every node" in out.stdout + out.stderr
    assert all_versions(project) == before


def test_replay_of_one_step_uses_its_own_adapter_and_is_marked(project: Path) -> None:
    metrics = pd.read_parquet(newest(project / "data" / "08_reporting" / "training_metrics.parquet"))
    step_dir = project / "data" / "07_model_output" / "rollouts" / metrics["run"].iloc[0] / "step_000003"
    original = pd.read_parquet(next(step_dir.glob("*.parquet")))
    out = kedro(project, "run", "--nodes=rl_loop.generate_rollouts", "--params", "replay.step=3")
    assert "replaying step 3 of run" in out.stdout + out.stderr and "adapter after step 2" in out.stdout + out.stderr
    replays = list(step_dir.glob("*.replay.parquet"))
    assert len(replays) == 1
    again = pd.read_parquet(replays[0])
    assert again["replay"].all() and list(again["completion"]) == list(original["completion"])
    assert [list(x) for x in again["logprobs"]] == [list(x) for x in original["logprobs"]]


def test_sigkill_and_resume_end_bitwise_equal_to_an_uninterrupted_run(project: Path) -> None:
    from safetensors.torch import load_file

    common = "qerl.rl.steps=6,qerl.rl.save_every=2"
    kedro(project, "run", "--pipelines=qerl_train", "--params", f"{common},qerl.rl.run_name=straight")
    args = ["run", "--pipelines=qerl_train", "--params", f"{common},qerl.rl.run_name=killed"]
    ckpt_root = project / "data" / "06_models" / "checkpoints" / "killed"
    proc = subprocess.Popen([KEDRO, *args], cwd=project, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and not list(ckpt_root.glob("*/step_000002/qerl_state.json")):
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = kedro(project, *args).stdout
    assert "resuming run killed/" in out and "from step " in out
    rep = project / "data" / "08_reporting" / "training_metrics.parquet"
    metrics = pd.read_parquet(newest(rep))
    assert metrics["step"].tolist() == list(range(1, 7))  # every step exactly once
    a = load_file(str(next((project / "data/06_models/checkpoints/straight").glob("*/step_000006")) / "adapter_model.safetensors"))
    b = load_file(str(next(ckpt_root.glob("*/step_000006")) / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.mark.parametrize("point", ["file_write", "dir_swap"])
def test_a_kill_inside_a_write_leaves_loadable_newest_versions(project: Path, point: str) -> None:
    env = {**_env(), "QERL_KILL_AT": f"{point}:{3 if point == 'file_write' else 1}"}
    args = ["run", "--pipelines=qerl_train", "--params", f"qerl.rl.steps=2,qerl.rl.run_name=kill_{point}"]
    proc = subprocess.run([KEDRO, *args], cwd=project, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL
    leftovers = [p for p in (project / "data").rglob(".partial-*")] + [p for p in (project / "data").rglob(".old-*")]
    assert leftovers, "the kill should have hit inside a write"
    kedro(project, *args)  # the next start cleans up (or recovers the swapped policy) and resumes
    assert not [p for p in (project / "data").rglob(".partial-*")] and not list((project / "data").rglob(".old-*"))
    assert (project / "data" / "06_models" / "policy" / "policy.json").exists()
    rep = project / "data" / "08_reporting"
    for name in ("training_metrics.parquet", "noise_metrics.parquet"):
        pd.read_parquet(newest(rep / name))
    pd.read_csv(newest(rep / "evaluation.csv"))
    pd.read_parquet(newest(project / "data" / "03_primary" / "train_prompts.parquet"))


def test_sigterm_stops_cleanly(project: Path) -> None:
    args = ["run", "--pipelines=qerl_train", "--params", "qerl.rl.steps=30,qerl.rl.run_name=term"]
    proc = subprocess.Popen([KEDRO, *args], cwd=project, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    root = project / "data" / "06_models" / "checkpoints" / "term"
    deadline = time.time() + 300
    while time.time() < deadline and not list(root.glob("*/adapters/step_000002")):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode not in (0, -signal.SIGTERM), "SIGTERM should stop the run through the interrupt path"
    assert not list((project / "data").rglob(".partial-*"))


def test_quant_study_then_a_replay_binds_to_the_qerl_train_run(project: Path) -> None:
    kedro(project, "run", "--pipelines=quant_study")
    rep = project / "data" / "08_reporting"
    summary = pd.read_csv(newest(rep / "quant_study_summary.csv"))
    assert summary["variant"].tolist() == ["none_param_noise", "nvfp4_aqn", "nvfp4_entropy_ctrl"]
    assert (summary["seeds"] == 2).all()
    runs = pd.read_csv(newest(rep / "quant_study_runs.csv"))
    assert len(runs) == 6 and runs["pass@1_after"].between(0, 1).all()
    assert (runs.groupby("variant")["kl_to_full_precision"].mean() > 0).all()
    metrics = pd.read_parquet(newest(rep / "quant_study_metrics.parquet"))
    assert metrics.groupby(["variant", "seed"])["step"].apply(list).map(lambda s: s == [1, 2]).all()
    assert {p.name for p in (rep / "quant_study_plots").glob("*/*/*.png")} == {"reward.png", "entropy.png", "final_pass1.png"}
    # the study's checkpoints are newer, but a replay of qerl_train's step 2 uses qerl_train's run
    out = kedro(project, "run", "--nodes=rl_loop.generate_rollouts", "--params", "replay.step=2")
    log = out.stdout + out.stderr
    assert "replaying step 2 of run embedded/" in log and "study_" not in log


def test_notebook_runs_on_catalog_outputs_and_shows_plots(project: Path) -> None:
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    nb = nbformat.read(project / "notebooks" / "qerl_analysis.ipynb", as_version=4)
    os.environ["QERL_PROJECT_PATH"] = str(project)
    try:
        NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(project)}}).execute()
    finally:
        os.environ.pop("QERL_PROJECT_PATH", None)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    texts = [o.get("text", "") for o in outputs]
    assert any("completions over" in t for t in texts)
    assert any("none_param_noise" in t for t in texts)
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 4, "the notebook's figures must render inline"


def test_replay_without_a_run_names_the_pipeline(tmp_path: Path) -> None:
    fresh = make_project(tmp_path)
    proc = kedro(fresh, "run", "--nodes=rl_loop.generate_rollouts", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "kedro run --pipelines=qerl_train" in proc.stderr
