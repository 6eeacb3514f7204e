#!/usr/bin/env bash
# The device calls of the GPU benches (issue 9), one function per call; run from the repository root on
# the lent H200 with $OUT set (what is written there comes back). Exact commands behind bench/results/GPU.md.
#
#   bash bench/gpu_run.sh learner-step 7b [VARIANT...]  # carry [".whl"] (tyro, rich and their pure-Python
#                                        # dependencies; msgspec and pyzmq come with vLLM in /tmp/site): the
#                                        # learner's own train step vs the padded baseline, 30% of the GPU held
#                                        # back for a co-located generator (bench/learner_step.py); 3b likewise
#   bash bench/gpu_run.sh weight-sync    # carry [".whl"]: weight sync 7B (CUDA IPC vs gloo)
#   bash bench/gpu_run.sh stage 1        # carry [".gpu/p1"]   } back to back: /tmp survives only while the
#   bash bench/gpu_run.sh stage 2        # carry [".gpu/p2"]   } machine stays warm (30 s after a call)
#   bash bench/gpu_run.sh vllm           # carry [".gpu/p3"]: install vLLM; batch-preparation bench on the host's
#                                        # cores; generator bench (engine core in its own process: batch and
#                                        # continuous loops) + pipeline smoke run; then "continuous" if time is
#                                        # left (whole call <= ~9.3 min)
#   bash bench/gpu_run.sh continuous     # (no carry) after "vllm": batch loop vs continuous batching, 3B
#   bash bench/gpu_run.sh vllm-continuous  # carry [".gpu/p3"] after the stage calls: install, "continuous",
#                                        # batch-preparation bench, GPU tests
#   bash bench/gpu_run.sh vllm-tests [K]  # carry [".gpu/p3"] after the stage calls: install, GPU tests (-k K)
#   bash bench/gpu_run.sh vllm-smoke     # carry [".gpu/p3"] after the stage calls: smoke run, in-flight updates
#   bash bench/gpu_run.sh vllm-extra     # (no carry) after "vllm": 7B CUDA-IPC sync into vLLM, in-process column
# GPU tests: python3 -m pytest -q -m gpu tests/gpu (after "vllm": pyzmq comes with the bundle).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

stage() {  # copy vLLM bundle part $1 to /tmp/stage (kept while the machine stays warm)
  mkdir -p /tmp/stage && cp ".gpu/p$1"/part* /tmp/stage/
}

wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site0 .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD:/tmp/site0
}

run() {  # run NAME SECONDS CMD...: log to $OUT/NAME.log, never longer than SECONDS
  local name=$1 secs=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/$name.log"
  timeout -k 15 "$secs" "$@" 2>&1 | tee -a "$OUT/$name.log"
  echo "=== $name exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.log"
}

install_vllm() {  # after "stage 1" and "stage 2" (parts in /tmp/stage): vLLM into /tmp/site, once per machine
  [ -d /tmp/site/vllm ] || bash .gpu/p3/install-on-device.sh .gpu/p3 > "$OUT/install.log" 2>&1 \
    || { tail "$OUT/install.log"; exit 3; }
}

continuous() {  # the generator loop, one generate call per batch vs continuous batching, long-tailed lengths
  PYTHONPATH=/tmp/site run generator_continuous "$1" python3 -m bench.generator_continuous --gpu \
    --model 3b --prompts 256 --batch 64 --admit 16 --max-tokens 512 --stop-frac 0.003 \
    --image-side 448 --repeats 2 --out "$OUT/generator_continuous_h200.json"
}

case "${1:-}" in
  learner-step)  # carry [".whl"]: bench.learner_step on model $2 (7b | 3b) with variants $3... (default: its own)
    wheels
    model=$2; shift 2
    run "learner_step_$model" 530 python3 -m bench.learner_step --model "$model" --reserve-frac 0.3 \
      --out "$OUT/learner_step_$model.json" ${1:+--variants "$@"}
    ;;
  weight-sync)  # carry [".whl"]: weight sync 7B (CUDA IPC vs gloo)
    wheels
    run weight_sync 200 python3 -m bench.gpu_weight_sync --out "$OUT/gpu_weight_sync.json" --syncs 10 --gloo-syncs 1
    ;;
  stage)  # carry [".gpu/p$2"]: one vLLM bundle part into /tmp/stage
    stage "$2"; ls -la /tmp/stage
    ;;
  vllm)  # carry [".gpu/p3"], right after "stage 1" and "stage 2": install vLLM, then (each step time-boxed)
    # 1. batch preparation on the host's cores (bench.generator_prep, instant fake engine);
    # 2. generator bench, 3B, 64 + 512 prompts: bare vLLM vs the Parallax loop (batch and continuous) on ONE
    #    engine whose core runs in its own process (the default on CUDA), then the pipeline smoke run on it;
    # 3. batch loop vs continuous batching on long-tailed lengths (the "continuous" call), if >= 150 s are left.
    # (Session 3's call also ran the 7B CUDA-IPC sync into vLLM and the in-process column: "vllm-extra".)
    install_vllm
    export PYTHONPATH=/tmp/site
    run generator_prep 60 python3 -m bench.generator_prep --repeats 3 --out "$OUT/generator_prep_h200.json"
    run generator 330 python3 -m bench.gpu_generator --out "$OUT/gpu_generator.json" --smoke-steps 3
    nvidia-smi --query-gpu=memory.used --format=csv | tee -a "$OUT/generator.log"
    left=$((555 - SECONDS))
    if [ "$left" -ge 150 ]; then continuous "$left"; else echo "skipped continuous: ${left} s left"; fi
    ;;
  vllm-continuous)  # carry [".gpu/p3"], after "stage 1" and "stage 2" (session 4's second chain): install vLLM,
    # the continuous comparison, the batch-preparation bench, then the GPU tests with the time left
    install_vllm
    export PYTHONPATH=/tmp/site
    continuous 300
    run generator_prep 60 python3 -m bench.generator_prep --repeats 3 --out "$OUT/generator_prep_h200.json"
    run gpu_tests $((570 - SECONDS)) python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider
    ;;
  vllm-tests)  # carry [".gpu/p3"], after "stage 1" and "stage 2": install vLLM, then the GPU tests
    install_vllm
    PYTHONPATH=/tmp/site run gpu_tests 500 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider ${2:+-k "$2"}
    ;;
  vllm-smoke)  # carry [".gpu/p3"], after "stage 1" and "stage 2": install vLLM, then the pipeline smoke run with
    # continuous batching and in-flight weight updates (512-token responses: generation outlasts a learner step)
    install_vllm
    PYTHONPATH=/tmp/site run smoke_inflight 330 python3 -m bench.gpu_smoke --steps 4 --mode inflight \
      --max-tokens 512 --out "$OUT/gpu_smoke_inflight.json"
    ;;
  vllm-extra)  # after "vllm": 7B CUDA-IPC sync into vLLM, the in-process engine column
    export PYTHONPATH=/tmp/site
    run weight_sync_vllm 190 python3 -m bench.gpu_weight_sync --engine vllm --model 7b --paths ipc --syncs 5 \
      --out "$OUT/gpu_weight_sync_vllm.json"
    run generator_inprocess 330 python3 -m bench.gpu_generator --engine-core inprocess --smoke-steps 0 \
      --out "$OUT/gpu_generator_inprocess.json"
    ;;
  continuous)  # right after "vllm" (vLLM in /tmp/site, the random 3B checkpoint in /tmp/parallax-ckpt/3b)
    continuous 420
    ;;
  *) echo "usage: bash bench/gpu_run.sh learner-step 7b|3b [VARIANT...] | weight-sync | stage 1|2 | vllm |"\
       "vllm-continuous | vllm-tests [K] | vllm-smoke | vllm-extra | continuous"; exit 2 ;;
esac
