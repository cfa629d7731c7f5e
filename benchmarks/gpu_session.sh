#!/usr/bin/env bash
# The GPU benchmarks and tests of issues #9, #10 and #16 on the device machine, in the order given,
# each phase time-boxed; everything measured is written under $OUT as it goes (at most 8 files come
# back). From the repo root, with .whl/ (humming-kernels, tabulate) and, for paper7b, .whl_kedro/
# (pydantic, bitsandbytes, kedro, ...) carried (benchmarks/gpu_wheels.sh fetches both here).
# pytest's addopts already say -q: the phases add none (-qq would hide the summary line):
#   bash benchmarks/gpu_session.sh "tests tune rollout7b64 rollout7b1 rollout32b"
#   bash benchmarks/gpu_session.sh "rlstep7b rlstep32b rlstep72b"
#   bash benchmarks/gpu_session.sh paper7b     (one phase per call: about 9 minutes)
# RTAG: a suffix of the rollout phases' JSON names (a second run of a row in one call).
# The humming tuning file ($OUT/humming_tuning.json) starts as a copy of the one the package ships
# for this GPU (src/qerl/kernels/tuned/), so what a tune phase writes there is the whole file to ship.
set -x
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 KEDRO_DISABLE_TELEMETRY=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl $(ls .whl_kedro/*.whl 2>/dev/null) || exit 1  # .whl_kedro: paper7b only
export PYTHONPATH=/tmp/site:$PWD/src
export QERL_HUMMING_TUNING=$OUT/humming_tuning.json
SHIPPED=$(python3 -c "from qerl.kernels.tuning import shipped_path; print(shipped_path())")
[ -f "$SHIPPED" ] && [ ! -f "$QERL_HUMMING_TUNING" ] && cp "$SHIPPED" "$QERL_HUMMING_TUNING"  # once per $OUT
exec > >(tee -a "$OUT/run.log") 2>&1
PHASES=${1:-"tests tune rollout7b64 rollout7b1 rollout32b"}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv
python3 -c "import torch, transformers, humming, triton, peft; print(torch.__version__, transformers.__version__, humming.__version__, triton.__version__, peft.__version__)"
start=$(date +%s)
RL="python3 benchmarks/rl_step.py"
for phase in $PHASES; do
  echo "=== $phase at +$(( $(date +%s) - start ))s ($(date -u +%H:%M:%S) UTC)"
  case $phase in
    tests)
      timeout 60 python3 -c "
import torch; x = torch.randn(64, 152064, device='cuda'); torch.sort(x, -1); g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g): torch.sort(x, -1, descending=True)
    print('torch.sort [64, 152064] captured')
except Exception as e: print('torch.sort [64, 152064] not capturable:', repr(e)[:300])"
      timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -v -p no:cacheprovider -n 8 -rfE \
        tests/kernels/test_gpu_fp4.py tests/kernels/test_dispatch.py \
        tests/rollout/test_decode_kernels.py \
        tests/rollout/test_fast_engine.py::test_gpu_graph_engine_matches_teacher_forcing \
        tests/rollout/test_fast_engine.py::test_gpu_waves_match_teacher_forcing \
        tests/rollout/test_fast_engine.py::test_gpu_graph_captured_at_real_model_width \
        tests/rollout/test_fast_engine.py::test_gpu_single_copy_keeps_one_copy_and_the_same_rollout 2>&1 | tee "$OUT/gpu_tests.log" ;;
    samplertests)  # the sampling kernels against torch on the GPU, and the engine graph at real width
      timeout 100 python3 -m pytest -p no:cacheprovider -n 8 -rfE tests/rollout/test_decode_kernels.py -k "(sample or real_model_width) and not hopper" \
        tests/rollout/test_fast_engine.py::test_gpu_graph_captured_at_real_model_width 2>&1 | tail -15 ;;
    loratests)  # the fused LoRA kernel against float32 on the GPU, then the engine's GPU tests that run it
      # (two pytest calls: a -k filter would apply to every file given and deselect the engine tests,
      # as it did in runs 21-22 and 25 of docs/benchmarks.md)
      timeout 60 python3 -m pytest -p no:cacheprovider -n 8 -rfE tests/rollout/test_decode_kernels.py -k "lora" 2>&1 | tail -15
      echo "pytest rc=${PIPESTATUS[0]}"
      timeout 150 python3 -m pytest -p no:cacheprovider -n 8 -rfE \
        tests/rollout/test_fast_engine.py::test_gpu_graph_engine_matches_teacher_forcing \
        tests/rollout/test_fast_engine.py::test_gpu_graph_captured_at_real_model_width \
        tests/rollout/test_fast_engine.py::test_gpu_waves_match_teacher_forcing \
        tests/rollout/test_fast_engine.py::test_gpu_single_copy_keeps_one_copy_and_the_same_rollout \
        tests/kernels/test_tuning_cache.py 2>&1 | tail -25; echo "pytest rc=${PIPESTATUS[0]}" ;;
    attn)  # the decode attention alone (benchmarks/attention.py): splits, launch variants (ATTN_TUNES)
      timeout ${ATTN_TIMEOUT:-90} python3 benchmarks/attention.py --model ${ATTN_MODEL:-7b} --rows ${ATTN_ROWS:-1,64} \
        --ctx ${ATTN_CTX:-256} --splits ${ATTN_SPLITS:-0,1,2,6} ${ATTN_TUNES:+--tunes $ATTN_TUNES} --json "$OUT/attention_${ATTN_MODEL:-7b}.json" ;;
    ropetests)  # the decode attention (RoPE and the K/V write in its launch, the splits merged in it)
      # against torch, then the engine at 7B width (two pytest calls)
      timeout 100 python3 -m pytest -p no:cacheprovider -n 8 -rfE tests/rollout/test_decode_kernels.py \
        -k "attention or rope" 2>&1 | tail -15; echo "pytest rc=${PIPESTATUS[0]}"
      timeout ${ROPETESTS_TIMEOUT:-150} python3 -m pytest -p no:cacheprovider -n 8 -rfE \
        tests/rollout/test_fast_engine.py::test_gpu_graph_captured_at_real_model_width 2>&1 | tail -15
      echo "pytest rc=${PIPESTATUS[0]}" ;;
    layouttests)  # humming's NVFP4 copy with bf16 group scales against the float32 reference and the ct layout
      timeout 100 python3 -m pytest -p no:cacheprovider -n 8 -rfE tests/kernels/test_gpu_fp4.py -k "humming" 2>&1 | tail -15
      echo "pytest rc=${PIPESTATUS[0]}" ;;
    pdltests)  # programmatic dependent launch and the LoRA beside the GEMM: the rollout against teacher
      # forcing with and without them (6 cases, 7B widths; 8 cases did not finish in 180 s, run 61)
      timeout ${PDLTESTS_TIMEOUT:-200} python3 -m pytest -p no:cacheprovider -n 6 -rfE \
        tests/rollout/test_fast_engine.py::test_gpu_pdl_rollout_matches_teacher_forcing 2>&1 | tail -25
      echo "pytest rc=${PIPESTATUS[0]}" ;;
    singlecopy)  # the single-copy engine leaves nothing of a call behind (cuBLAS workspaces included)
      timeout 90 python3 -m pytest -v -p no:cacheprovider -rfE \
        tests/rollout/test_fast_engine.py::test_gpu_single_copy_keeps_one_copy_and_the_same_rollout 2>&1 | tail -30 ;;
    tune)  # humming's heuristic and its neighbours per decode shape, timed in CUDA graphs with a cold L2
      timeout ${TUNE_TIMEOUT:-70} python3 -m qerl.kernels.tune --models ${TUNE_MODELS:-7b,32b} --formats nvfp4 \
        --layouts ${TUNE_LAYOUTS:-ct,bf16_scales} --ms ${TUNE_MS:-1,32,64} --budget-s $(( ${TUNE_TIMEOUT:-70} - 15 )) --json "$OUT/tune.json" ;;
    tunewide)  # the wide search (tiles, then variations of the fastest two) of TUNE_ONLY's layers (all
      # four by default) of TUNE_MODELS at TUNE_MS, bf16-scale layout, at most TUNE_SHAPE_S seconds a shape;
      # TUNE_SMS: for that many multiprocessors (the GEMM beside the fused LoRA: all but lora_sms, 8)
      timeout ${TUNE_TIMEOUT:-300} python3 -m qerl.kernels.tune --models ${TUNE_MODELS:-7b} --formats nvfp4 \
        --layouts bf16_scales --ms ${TUNE_MS:-1,64} ${TUNE_ONLY:+--only $TUNE_ONLY} --search wide \
        ${TUNE_SMS:+--sms $TUNE_SMS} --shape-budget-s ${TUNE_SHAPE_S:-60} --budget-s $(( ${TUNE_TIMEOUT:-300} - 15 )) \
        --json "$OUT/tune_wide_$(echo "${TUNE_MODELS:-7b}_${TUNE_MS:-1,64}_${TUNE_ONLY:-all}${TUNE_SMS:+_sms$TUNE_SMS}" | tr , -).json" ;;
    overhead)  # what a small humming GEMM costs besides its bytes (fp4_matmul.py --overhead)
      timeout ${OVERHEAD_TIMEOUT:-90} python3 benchmarks/fp4_matmul.py --overhead --ms ${OVERHEAD_MS:-1,64} \
        --json "$OUT/fp4_overhead.json" ;;
    overheadsplit)  # where that cost is: configs without stream-K / with one CTA a multiprocessor, K, cuBLAS
      timeout ${OVERHEAD_TIMEOUT:-120} python3 benchmarks/fp4_matmul.py --overhead-split \
        --json "$OUT/fp4_overhead_split.json" ;;
    smsscan)  # the decode GEMMs on 1/4 .. all of the multiprocessors: DRAM-bound or bound per multiprocessor
      F=${SMSSCAN_FMT:-nvfp4}; LAY=${SMSSCAN_LAYOUT:-bf16_scales}
      timeout ${SMSSCAN_TIMEOUT:-150} python3 benchmarks/fp4_matmul.py --sms-scan --model ${SMSSCAN_MODEL:-7b} \
        --ms ${SMSSCAN_MS:-1,64} --fmt $F --layout $LAY \
        --json "$OUT/fp4_sms_scan_${SMSSCAN_MODEL:-7b}_${F}_${LAY}.json" ;;
    ncu)  # Nsight Compute on one humming GEMM (NCU_SPECS: "model:shape:M ..."), boost clocks kept
      if ! command -v ncu >/dev/null; then echo "ncu: not on this machine"; else
        for spec in ${NCU_SPECS:-32b:gate_up:32 7b:qkv:1}; do IFS=: read -r mdl shp mm <<< "$spec"
          timeout ${NCU_TIMEOUT:-120} ncu --clock-control none -k regex:humming --launch-skip 1 --launch-count 1 \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
            --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis \
            --section Occupancy --section LaunchStats \
            python3 benchmarks/fp4_matmul.py --launch $shp --model $mdl --ms $mm > "$OUT/ncu_${mdl}_${shp}_m${mm}.txt" 2>&1
          echo "ncu $spec rc=$?"; grep -E "Duration|Throughput|Issue Slots Busy|No Eligible|Stall|Executed Ipc|Pipe" "$OUT/ncu_${mdl}_${shp}_m${mm}.txt" | head -40
        done
      fi ;;
    halves)  # gate/up and down as one GEMM or two halves at once (do a second GEMM's CTAs fill the first's idle SMs?)
      timeout ${HALVES_TIMEOUT:-150} python3 benchmarks/fp4_matmul.py --halves --model ${HALVES_MODEL:-32b} \
        --ms ${HALVES_MS:-32} --json "$OUT/fp4_halves_${HALVES_MODEL:-32b}.json" ;;
    gemv|gemvtests)  # our FP4 GEMV (qerl.kernels.fp4_gemv) and the LoRA in its launch: GPU tests,
      # then (gemv) against humming per decode shape
      timeout ${GEMVTESTS_TIMEOUT:-240} python3 -m pytest -p no:cacheprovider -n 8 -rfE tests/kernels/test_fp4_gemv.py \
        tests/kernels/test_fp4_gemv_lora.py \
        tests/rollout/test_fast_engine.py::test_gpu_gemv_rollout_matches_teacher_forcing 2>&1 | tail -15
      echo "pytest rc=${PIPESTATUS[0]}"
      [ $phase = gemvtests ] || timeout ${GEMV_TIMEOUT:-200} python3 benchmarks/fp4_matmul.py --model ${GEMV_MODEL:-7b} --ms ${GEMV_MS:-1,4} ${GEMV_ONLY:+--only $GEMV_ONLY} \
        --methods ${GEMV_METHODS:-cublas_bf16,humming_bf16s_pdl_nvfp4,gemv4x1p0_pdl_nvfp4,gemv4x2p0_pdl_nvfp4,gemv8x1p0_pdl_nvfp4,gemv8x2p0_pdl_nvfp4,gemv8x4p0_pdl_nvfp4,gemv16x2p0_pdl_nvfp4,gemv4x2p1_pdl_nvfp4,gemv8x1p1_pdl_nvfp4,gemv8x2p1_pdl_nvfp4,gemv_pdl_mxfp4} \
        --json "$OUT/fp4_gemv_${GEMV_MODEL:-7b}.json" ;;
    micro)
      timeout 120 python3 benchmarks/fp4_matmul.py --model 7b --ms 1,64 --json "$OUT/fp4_matmul.json" ;;
    crossover)
      timeout 90 python3 benchmarks/fp4_matmul.py --model 7b --crossover --ms 128,512,1024,2048 \
        --json "$OUT/fp4_crossover.json" ;;
    train)
      timeout 60 python3 benchmarks/fp4_matmul.py --train --json "$OUT/fp4_train.json" ;;
    sampling)
      timeout 120 python3 benchmarks/sampling.py --rows ${SAMPLING_ROWS:-1,64,128,1024} --logits ${SAMPLING_LOGITS:-normal} \
        --chunks "${SAMPLING_CHUNKS:-}" --json "$OUT/sampling_${SAMPLING_LOGITS:-normal}.json" ;;
    rollout7b64)
      timeout ${R64_TIMEOUT:-150} python3 benchmarks/rollout_throughput.py --rows 7b-64 --check --profile \
        --columns ${COLS_7B64:-fast_bf16,fast_nvfp4,fast_nvfp4_lora,fast_mxfp4_lora} \
        --json "$OUT/rollout_7b64${RTAG}.json" ;;
    rollout7b1)
      timeout ${R1_TIMEOUT:-90} python3 benchmarks/rollout_throughput.py --rows 7b-1 --profile \
        --columns ${COLS_7B1:-fast_bf16,fast_nvfp4,fast_nvfp4_lora} --json "$OUT/rollout_7b1${RTAG}.json" ;;
    rollout7b8)
      timeout ${R8_TIMEOUT:-90} python3 benchmarks/rollout_throughput.py --rows 7b-8 \
        --columns ${COLS_7B8:-fast_bf16,fast_nvfp4_lora} --json "$OUT/rollout_7b8.json" ;;
    rollout7b1long)  # B=1, 2048 new tokens: the decode attention split over the KV slots, and not
      timeout 150 python3 benchmarks/rollout_throughput.py --rows 7b-1-2k \
        --columns fast_bf16,fast_nvfp4_lora --json "$OUT/rollout_7b1long.json"
      timeout 60 python3 benchmarks/rollout_throughput.py --rows 7b-1-2k --attention-splits 1 \
        --columns fast_nvfp4_lora --json "$OUT/rollout_7b1long_nosplit.json" ;;
    rollout32b)
      timeout ${R32_TIMEOUT:-120} python3 benchmarks/rollout_throughput.py --rows 32b-32 ${PROFILE_32B:+--profile} \
        --columns ${COLS_32B:-fast_bf16,fast_nvfp4_lora} --json "$OUT/rollout_32b32${RTAG}.json" ;;
    updatemem)  # activation bytes per token of the update, checkpointing on and off
      timeout 60 python3 benchmarks/update_memory.py --model 7b --format nvfp4 --rows 2,4 --json "$OUT/update_memory.json" ;;
    rlstep7b)  # the paper-like workload: 16 prompts x 8 samples, prompt 256, 1024 new tokens, 2 steps, 64 GiB
      timeout 250 $RL --cells 7b/none,7b/nvfp4 --memory-budget 64 --json "$OUT/rl_step_7b.json" ;;
    rlstep32b)  # memory at 32B: 2 prompts x 8 samples, one step, budgets for a 40 GiB GPU
      timeout 150 $RL --cells 32b/nvfp4 --prompts 2 --steps 1 --memory-budget 38 --kv-budget 10 --single-copy \
        --json "$OUT/rl_step_32b.json" ;;
    paper7b)  # issue #10 item 5: kedro run -e gpu_paper at the paper's batch on a random 7B (152k vocabulary);
      # a checkpoint every step, so calling it again (machine still warm) resumes where the time box stopped it
      pkill -f "python3 -m [k]edro" && sleep 3  # a run a previous call's time box left behind
      QERL_PRESET_SIZE=paper QERL_PRESET_STEPS=${PAPER_STEPS:-2} timeout ${PAPER_TIMEOUT:-540} \
        bash benchmarks/gpu_preset_smoke.sh qwen2.5-7b "$OUT/paper7b" ;;
    rlstep72b)  # memory at 72B: budgets for an 80 GiB GPU
      timeout 200 $RL --cells 72b/nvfp4 --prompts 2 --steps 1 --memory-budget 76 --kv-budget 20 --single-copy \
        --json "$OUT/rl_step_72b.json" ;;
  esac
  echo "=== $phase rc=$? at +$(( $(date +%s) - start ))s"
done
