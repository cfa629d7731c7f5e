"""Time the README's main command on a fresh clone and report what it produced.

    .venv/bin/python benchmarks/main_command.py [--clone-to /tmp/qerl_clean] [--out benchmarks/results/main_command.json]

Clones this repository (committed state) into a fresh directory, runs ``make setup`` (venv +
install) and then ``make run`` (embedded model + qerl_train), timing each, and reads the catalog
outputs: the embedded model's held-out accuracy and build time, and held-out greedy pass@1 / pass@k
before and after RL. Prints a table and writes JSON. Run it on an otherwise idle machine: the
tiny model's torch threads are badly slowed by other CPU-heavy processes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def newest(path: Path, pattern: str) -> Path:
    return sorted(path.glob(pattern))[-1]


def timed(cmd: list[str], cwd: Path, log: Path) -> float:
    t0 = time.perf_counter()
    with log.open("w") as f:
        subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clone-to", default="/tmp/qerl_main_command")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "main_command.json"))
    args = ap.parse_args()
    dest = Path(args.clone_to)
    shutil.rmtree(dest, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(ROOT), str(dest)], check=True)
    setup_s = timed(["make", "setup"], dest, dest / "setup.log")
    run_s = timed(["make", "run"], dest, dest / "run.log")
    rep = dest / "data" / "08_reporting"
    acc = pd.read_csv(newest(rep / "embedded_model_accuracy.csv", "*/*.csv")).iloc[0]
    ev = pd.read_csv(newest(rep / "evaluation.csv", "*/*.csv")).set_index("stage")
    metrics = pd.read_parquet(newest(rep / "training_metrics.parquet", "*/*.parquet"))
    k = int(ev.loc["after", "k"])
    result = {
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}",
        "command": "make setup && make run (fresh clone)",
        "install_seconds": round(setup_s, 1),
        "run_seconds": round(run_s, 1),
        "total_seconds": round(setup_s + run_s, 1),
        "embedded_accuracy": float(acc["greedy_accuracy"]),
        "embedded_build_seconds": float(acc["build_seconds"]),
        "embedded_params": int(acc["n_params"]),
        "rl_steps": int(metrics["step"].max()),
        "pass1_before": float(ev.loc["before", "pass@1_greedy"]),
        "pass1_after": float(ev.loc["after", "pass@1_greedy"]),
        f"pass{k}_before": float(ev.loc["before", f"pass@{k}"]),
        f"pass{k}_after": float(ev.loc["after", f"pass@{k}"]),
        "rl_seconds": float(metrics["time/step"].sum()),
    }
    result["gain_points"] = round(100 * (result["pass1_after"] - result["pass1_before"]), 1)
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")  # noqa: T201
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
