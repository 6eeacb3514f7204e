#!/usr/bin/env bash
# The device calls of the GPU benches (issue 9), one function per call; run from the repository root on
# the lent H200 with $OUT set (what is written there comes back). Exact commands behind bench/results/GPU.md.
#
# Three calls back to back (the machine keeps /tmp only while warm, 30 s after a call):
#   bash bench/gpu_run.sh call1   # carry [".gpu/p1", ".whl"]: stage vLLM part 1; learner step, 7B and 3B
#   bash bench/gpu_run.sh call2   # carry [".gpu/p2", ".whl"]: stage part 2; weight sync 7B, CUDA IPC vs gloo
#   bash bench/gpu_run.sh call3   # carry [".gpu/p3"]: install vLLM; generator bench, pipeline smoke run, tests/gpu
# .whl holds the msgspec wheel for cp312 (the image lacks it; the vLLM bundle brings it in call 3).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

stage() {  # copy vLLM bundle part $1 to /tmp/stage (kept while the machine stays warm)
  mkdir -p /tmp/stage && cp ".gpu/p$1"/part* /tmp/stage/
}

wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site0 .whl/*.whl && export PYTHONPATH=/tmp/site0
}

run() {  # run NAME SECONDS CMD...: log to $OUT/NAME.log, never longer than SECONDS
  local name=$1 secs=$2; shift 2
  echo "=== $name: $*" | tee -a "$OUT/$name.log"
  timeout "$secs" "$@" 2>&1 | tee -a "$OUT/$name.log"
  echo "=== $name exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.log"
}

case "${1:-}" in
  call1)  # carry [".gpu/p1", ".whl"]
    stage 1; wheels
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,power.draw --format=csv > "$OUT/nvidia-smi.csv"
    run learner 330 python3 -m bench.gpu_learner --out "$OUT/gpu_learner.json" --steps 2 --baseline-steps 1
    ;;
  call2)  # carry [".gpu/p2", ".whl"]
    stage 2; wheels
    run weight_sync 200 python3 -m bench.gpu_weight_sync --out "$OUT/gpu_weight_sync.json" --syncs 10 --gloo-syncs 1
    ;;
  call3)  # carry [".gpu/p3"]
    [ -d /tmp/site/vllm ] || bash .gpu/p3/install-on-device.sh .gpu/p3 > "$OUT/install.log" 2>&1 \
      || { cat "$OUT/install.log"; exit 3; }
    export PYTHONPATH=/tmp/site
    run generator 450 python3 -m bench.gpu_generator --out "$OUT/gpu_generator.json" --smoke-steps 4
    run tests 90 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider
    ;;
  *) echo "usage: bash bench/gpu_run.sh call1 | call2 | call3"; exit 2 ;;
esac
