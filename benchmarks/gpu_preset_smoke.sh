#!/usr/bin/env bash
# The GPU preset (conf/gpu_paper: the paper's hyperparameters) end to end on CUDA, on a
# random-init Qwen2.5 architecture and a synthetic GSM8K-format file (no downloads anywhere).
# Sizes are cut down (steps, prompts, lengths) so it runs in a couple of minutes; no learning is
# expected from a random model. Usage on a GPU machine, from the project root:
#   bash benchmarks/gpu_preset_smoke.sh [arch] [out_dir]
# QERL_PRESET_SIZE=paper keeps the preset's batch (128 prompts x 8 samples, 1024 new tokens) and
# the architecture's real 152k vocabulary, for QERL_PRESET_STEPS steps (default 2; a checkpoint
# every step, so a rerun resumes), with evaluation and the noise report cut down:
#   QERL_PRESET_SIZE=paper bash benchmarks/gpu_preset_smoke.sh qwen2.5-7b
set -euo pipefail
ARCH=${1:-qwen2.5-0.5b}
OUT=${2:-${OUT:-/tmp/qerl_gpu_smoke}}
SIZE=${QERL_PRESET_SIZE:-smoke}
mkdir -p "$OUT"
export KEDRO_DISABLE_TELEMETRY=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
export KEDRO_LOGGING_CONFIG=conf/logging.yml PYTHONPATH="$PWD/src:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "$SIZE" = paper ]; then
  [ -f data/06_models/base_model/config.json ] && grep -q '"vocab_size": 152064' data/06_models/base_model/config.json \
    || python3 -m qerl.modeling.random_init --arch "$ARCH" --out data/06_models/base_model --real-vocab \
         --gsm8k data/01_raw/gsm8k_train.jsonl --gsm8k-size 2000
else
  python3 -m qerl.modeling.random_init --arch "$ARCH" --out data/06_models/base_model \
    --gsm8k data/01_raw/gsm8k_train.jsonl --gsm8k-size 800
fi
OPT=adamw8bit
python3 - <<'PY' || OPT=adamw
import bitsandbytes as bnb, torch
p = torch.nn.Parameter(torch.randn(64, 64, device="cuda")); o = bnb.optim.AdamW8bit([p], lr=1e-3)
p.grad = torch.randn_like(p); o.step(); torch.cuda.synchronize(); print("bitsandbytes AdamW8bit OK on CUDA")
PY
echo "optimizer: $OPT" | tee -a "$OUT/gpu.txt"
if [ "$SIZE" = paper ]; then
  PARAMS="qerl.rl.steps=${QERL_PRESET_STEPS:-2},qerl.rl.optimizer=$OPT,qerl.rl.save_every=1"
  PARAMS="$PARAMS,qerl.eval.max_prompts=16,qerl.eval.max_new_tokens=128"
else
  PARAMS="qerl.rl.steps=3,qerl.rl.prompts_per_step=16,qerl.rl.optimizer=$OPT,qerl.rl.save_every=3"
  PARAMS="$PARAMS,qerl.rollout.max_new_tokens=128,qerl.eval.max_prompts=32,qerl.eval.max_new_tokens=128"
fi
PARAMS="$PARAMS,qerl.report.max_new_tokens=64,qerl.report.probe_size=16,data.eval_size=64"
# a random model scores 0 on every sample, so every advantage is 0; the small entropy bonus gives
# the LoRA update a non-zero gradient, so that the optimizer step on CUDA is exercised too
PARAMS="$PARAMS,${QERL_SMOKE_EXTRA:-qerl.rl.entropy_coef=0.01}"
ENGINE=${QERL_SMOKE_ENGINE:-auto}
TIMER=""; [ -x /usr/bin/time ] && TIMER="/usr/bin/time -v"
train() {  # train <engine>: the preset run, log in $OUT/run.log
  $TIMER python3 -m kedro run -e gpu_paper --pipelines=qerl_train \
    --params "$PARAMS,qerl.rollout.engine=$1" 2>&1 | tee "$OUT/run.log"
}
if ! train "$ENGINE"; then
  # keep the failing log, then show the loop on CUDA with the transformers-generate engine
  mv "$OUT/run.log" "$OUT/run_${ENGINE}_failed.log"; ENGINE=hf
  train hf
fi
echo "rollout engine: $ENGINE" | tee -a "$OUT/gpu.txt"
python3 - "$OUT" <<'PY'
import glob, sys, pandas as pd
out = sys.argv[1]
m = pd.read_parquet(sorted(glob.glob("data/08_reporting/training_metrics.parquet/*/*.parquet"))[-1])
cols = ["step", "reward/mean", "rollout/entropy", "noise/sigma", "rollout/tokens_per_s", "time/generate", "time/update",
        "memory/peak_gib", "mismatch/kl", "mismatch/logprob_gap_mean"]
print(m[cols].to_string(index=False)); m.to_csv(f"{out}/training_metrics.csv", index=False)
e = pd.read_csv(sorted(glob.glob("data/08_reporting/evaluation.csv/*/*.csv"))[-1]); print(e.to_string(index=False))
n = pd.read_parquet(sorted(glob.glob("data/08_reporting/noise_metrics.parquet/*/*.parquet"))[-1]); print(n.to_string(index=False))
e.to_csv(f"{out}/evaluation.csv", index=False); n.to_csv(f"{out}/noise_metrics.csv", index=False)
PY
