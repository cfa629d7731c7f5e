"""Print the newest ``quant_study`` results as the markdown table of docs/quantization-study.md and
write them as JSON.

    kedro run --pipelines=quant_study            # first: the study itself
    python3 benchmarks/quant_study_table.py [--project .] [--out benchmarks/results/quant_study.json]

After rerunning only some variants (a conf env whose ``quant_study.variants`` lists just those),
``--replace-into benchmarks/results/quant_study.json`` keeps the other variants' runs from that
earlier JSON and replaces the rerun ones.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

COLUMNS = [
    ("variant", "variant", "{}"),
    ("pass@1_after", "held-out greedy pass@1 after", "{:.3f} ± {:.3f}"),
    ("pass@1_gain", "gain over its own warm start (points)", "{:+.1f} ± {:.1f}"),
    ("pass@k_after", "pass@k after", "{:.3f} ± {:.3f}"),
    ("steps_to_threshold", "steps to reward threshold", "{:.1f} ± {:.1f}"),
    ("entropy_first_third", "entropy, first third (nats/token)", "{:.3f} ± {:.3f}"),
    ("kl_to_full_precision", "KL(fp ‖ base) (nats/token)", "{:.4f} ± {:.4f}"),
    ("seconds_per_step", "s / step", "{:.2f} ± {:.2f}"),
    ("peak_mem_gib", "peak RSS GiB", "{:.2f} ± {:.2f}"),
]


def newest(path: Path) -> Path:
    return sorted(p for p in path.glob("*/*") if p.is_file())[-1]


def table(runs: pd.DataFrame) -> tuple[str, list[dict]]:
    runs = runs.assign(**{"pass@1_gain": 100 * (runs["pass@1_after"] - runs["pass@1_before"])})
    rows, lines = [], ["| " + " | ".join(h for _, h, _ in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for variant, g in runs.groupby("variant", sort=False):
        row = {"variant": variant, "seeds": len(g)}
        cells = [variant]
        for col, _, fmt in COLUMNS[1:]:
            mean, std = float(g[col].mean()), float(g[col].std(ddof=1)) if len(g) > 1 else 0.0
            row[f"{col}_mean"], row[f"{col}_std"] = mean, std
            cells.append(fmt.format(mean, std) if pd.notna(mean) else "never")
        rows.append(row)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines), rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--project", default=".")
    ap.add_argument("--out", default="benchmarks/results/quant_study.json")
    ap.add_argument("--threshold", type=float, default=None,
                    help="recompute steps_to_threshold from the saved per-step metrics with this reward threshold")
    ap.add_argument("--replace-into", default=None,
                    help="earlier JSON whose runs are kept for the variants not in the newest run")
    args = ap.parse_args()
    rep = Path(args.project) / "data" / "08_reporting"
    runs_file = newest(rep / "quant_study_runs.csv")
    runs = pd.read_csv(runs_file)
    if args.threshold is not None:
        from qerl.study.summary import first_step_reaching

        metrics = pd.read_parquet(newest(rep / "quant_study_metrics.parquet"))
        steps = {k: first_step_reaching(m, "reward/mean", args.threshold) for k, m in metrics.groupby(["variant", "seed"])}
        runs["steps_to_threshold"] = [steps[(v, s)] for v, s in zip(runs["variant"], runs["seed"], strict=True)]
    sources = [str(runs_file)]
    if args.replace_into:
        old = json.loads(Path(args.replace_into).read_text())
        if old.get("threshold") != args.threshold:
            raise SystemExit(f"--replace-into {args.replace_into} was made with --threshold "
                             f"{old.get('threshold')}; pass the same --threshold so that "
                             "steps_to_threshold means the same for every run")
        kept = pd.DataFrame([r for r in old["runs"] if r["variant"] not in set(runs["variant"])])
        order = list(dict.fromkeys(r["variant"] for r in old["runs"]))
        order += [v for v in runs["variant"].unique() if v not in order]
        runs = pd.concat([kept, runs], ignore_index=True)
        runs = runs.iloc[sorted(range(len(runs)), key=lambda i: (order.index(runs["variant"][i]),
                                                                  runs["seed"][i]))]
        old_src = old.get("source")
        sources = [*(old_src if isinstance(old_src, list) else [old_src]), *sources]
    md, rows = table(runs)
    print(md)  # noqa: T201
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"source": sources if len(sources) > 1 else sources[0], "threshold": args.threshold, "variants": rows,
                               "runs": runs.to_dict("records")}, indent=2))


if __name__ == "__main__":
    main()
