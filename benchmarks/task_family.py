"""The embedded task family table: per preset, build the warm start and run RL over 3 seeds, both
through the project's own pipelines, in a fresh copy of the project, and read the catalog.

    .venv/bin/python benchmarks/task_family.py [--presets chain_sum_2x2,leg_counting] [--out benchmarks/results/task_family.json]

Per preset: ``kedro run --pipelines=embedded_model --params embedded_model.task.preset=NAME``, then
``kedro run -e task_study --pipelines=quant_study --params embedded_model.task.preset=NAME`` (NVFP4 +
AQN, seeds 0, 1, 2, the preset's RL settings, 200 held-out prompts, pass@8). Reports warm-start
accuracy (validation and held-out), SFT steps, build minutes, and per seed greedy pass@1 and pass@8
before and after RL and the RL minutes (wall clock of the study divided by the seeds). Prints a
markdown table and writes JSON. Run it on an otherwise idle machine for the minutes to mean much.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
KEDRO = str(Path(sys.executable).with_name("kedro"))
DEFAULT = "chain_sum_2x2,chain_sum_4x1,chain_sum_2x3,chain_sum_3x2,leg_counting,spell_backward,simple_equations,letter_counting"


def newest(path: Path) -> Path:
    return sorted(p for p in path.glob("*/*") if p.is_file())[-1]


def kedro(project: Path, *args: str) -> float:
    env = {**os.environ, "KEDRO_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "1", "QERL_TRACKING": "off"}
    t0 = time.perf_counter()
    with open(project / "run.log", "a") as log:
        subprocess.run([KEDRO, *args], cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def copy_project(dest: Path) -> Path:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    for item in ("pyproject.toml", "src", "conf"):
        src = ROOT / item
        (shutil.copytree(src, dest / item, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "local"))
         if src.is_dir() else shutil.copy(src, dest / item))
    (dest / "conf" / "local").mkdir(exist_ok=True)
    (dest / "data").mkdir()
    return dest


def one_preset(project: Path, name: str) -> dict:
    pick = f"embedded_model.task.preset={name}"
    build_s = kedro(project, "run", "--pipelines=embedded_model", "--params", pick)
    rep = project / "data" / "08_reporting"
    acc = pd.read_csv(newest(rep / "embedded_model_accuracy.csv")).iloc[0]
    rl_s = kedro(project, "run", "-e", "task_study", "--pipelines=quant_study", "--params", pick)
    runs = pd.read_csv(newest(rep / "quant_study_runs.csv"))
    seeds = [{"seed": int(r["seed"]), "pass1_before": float(r["pass@1_before"]), "pass1_after": float(r["pass@1_after"]),
              "pass8_before": float(r["pass@k_before"]), "pass8_after": float(r["pass@k_after"])} for _, r in runs.iterrows()]
    return {"preset": name, "val_accuracy": float(acc["val_accuracy"]), "heldout_accuracy": float(acc["greedy_accuracy"]),
            "in_band": bool(acc["in_band"]), "sft_steps": int(acc["sft_steps"]), "n_params": int(acc["n_params"]),
            "build_minutes": build_s / 60, "rl_minutes_per_seed": rl_s / 60 / max(1, len(seeds)), "seeds": seeds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default=DEFAULT)
    ap.add_argument("--project", default="/tmp/qerl_task_family")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "task_family.json"))
    args = ap.parse_args()
    out = {"date": dt.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
           "command": "benchmarks/task_family.py", "presets": []}
    for name in args.presets.split(","):
        project = copy_project(Path(args.project) / name)
        out["presets"].append(one_preset(project, name))
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(json.dumps(out["presets"][-1]), flush=True)  # noqa: T201
    print("| preset | warm start (val / held-out) | SFT steps | pass@1 before -> after (3 seeds) | lift (points) | pass@8 before -> after | minutes (build + RL per seed) |")  # noqa: T201
    print("|---|---|---|---|---|---|---|")  # noqa: T201
    for p in out["presets"]:
        s = pd.DataFrame(p["seeds"])
        lift = 100 * (s["pass1_after"] - s["pass1_before"])
        print(f"| `{p['preset']}` | {p['val_accuracy']:.1%} / {p['heldout_accuracy']:.1%} | {p['sft_steps']} | "  # noqa: T201
              f"{s['pass1_before'].mean():.3f} -> {s['pass1_after'].mean():.3f} ± {s['pass1_after'].std():.3f} | "
              f"{lift.mean():+.1f} ± {lift.std():.1f} | {s['pass8_before'].mean():.3f} -> {s['pass8_after'].mean():.3f} | "
              f"{p['build_minutes']:.1f} + {p['rl_minutes_per_seed']:.1f} |")


if __name__ == "__main__":
    main()
