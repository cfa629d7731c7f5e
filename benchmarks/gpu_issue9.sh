#!/usr/bin/env bash
# Issue #9 on the GPU machine, in priority order, each phase time-boxed; everything it measures is
# written under $OUT as it goes (at most 8 files). Usage (from the repo root, .whl/ carried):
#   bash benchmarks/gpu_issue9.sh "tests rollout7b64 rollout7b1 micro crossover train tune rollout32b"
set -x
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
export QERL_HUMMING_TUNING=$OUT/humming_tuning_h200.json
exec > >(tee -a "$OUT/run.log") 2>&1
PHASES=${1:-"tests rollout7b64 rollout7b1 micro crossover train"}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, transformers, humming, triton; print(torch.__version__, transformers.__version__, humming.__version__, triton.__version__)"
start=$(date +%s)
for phase in $PHASES; do
  echo "=== $phase at +$(( $(date +%s) - start ))s ($(date -u +%H:%M:%S) UTC)"
  case $phase in
    tests)
      timeout 150 python3 -m pytest -q -p no:cacheprovider -n 8 -rfE \
        tests/kernels/test_gpu_fp4.py tests/kernels/test_dispatch.py \
        tests/rollout/test_decode_kernels.py \
        tests/rollout/test_fast_engine.py::test_gpu_graph_engine_matches_teacher_forcing \
        tests/rollout/test_fast_engine.py::test_gpu_waves_match_teacher_forcing ;;
    tune)
      timeout 150 python3 -m qerl.kernels.tune --models 7b --formats nvfp4,mxfp4 --ms 1,64 \
        --budget-s 120 ;;
    micro)
      timeout 120 python3 benchmarks/fp4_matmul.py --model 7b --ms 1,64 \
        --legacy .legacy/fp4_matmul_legacy.py --json "$OUT/fp4_matmul.json" ;;
    crossover)
      timeout 90 python3 benchmarks/fp4_matmul.py --model 7b --crossover --ms 128,512,1024,2048 \
        --json "$OUT/fp4_crossover.json" ;;
    train)
      timeout 60 python3 benchmarks/fp4_matmul.py --train --json "$OUT/fp4_train.json" ;;
    rollout7b64)
      timeout 200 python3 benchmarks/rollout_throughput.py --rows 7b-64 --check --profile \
        --columns hf_bf16,fast_bf16,fast_nvfp4,fast_nvfp4_lora,fast_mxfp4,fast_mxfp4_lora,fast_nvfp4_lora_seq \
        --json "$OUT/rollout_7b64.json" ;;
    rollout7b1)
      timeout 120 python3 benchmarks/rollout_throughput.py --rows 7b-1 \
        --columns hf_bf16,fast_bf16,fast_nvfp4,fast_nvfp4_lora,fast_mxfp4_lora \
        --json "$OUT/rollout_7b1.json" ;;
    rollout32b)
      timeout 300 python3 benchmarks/rollout_throughput.py --rows 32b-32 \
        --columns hf_bf16,fast_bf16,fast_nvfp4,fast_nvfp4_lora,fast_mxfp4 \
        --json "$OUT/rollout_32b32.json" ;;
  esac
  echo "=== $phase rc=$? at +$(( $(date +%s) - start ))s"
done
