#!/usr/bin/env bash
# The GPU learning run through the launcher (deploy/configs/gpu_learn.toml): runs side by side on ONE GPU, each a
# full `python -m deploy` (its own broker, reward service, vLLM generator and learner sharing the GPU by CUDA IPC).
# Run from the repository root with the environment installed (vLLM on CUDA importable); MINUTES per run
# (default 7), CUDA_VISIBLE_DEVICES picks the GPU.
#
#   bash deploy/gpu_learn.sh learn         # the learning run (correction decoupled) + its control (shuffled images)
#   bash deploy/gpu_learn.sh corrections   # correction none / decoupled / tis / icepop, four runs side by side
#   bash deploy/gpu_learn.sh all           # learn + control + none / tis / icepop: five runs side by side
#   bash deploy/gpu_learn.sh lr            # learn (the config's lr) + learn at lr 5e-5 + the control, side by side
#   bash deploy/gpu_learn.sh sweep         # learn + learn at lr 1e-4 + the control, side by side
#   bash deploy/gpu_learn.sh seq           # the learning run alone on the GPU until 0.9 held out, then the control
#   bash deploy/gpu_learn.sh cpu [SET]     # a set (default learn) on CPU with a tiny override (mechanics only)
#
# Writes OUT/runs/<name>/ (default OUT=runs/gpu_learn; each launcher run directory: summary.json, curve.png,
# learner/metrics.jsonl, logs/), OUT/<set>.png (held-out accuracy and reward over wall-clock minutes, all runs of
# the set) and OUT/<set>.json (per run: accuracy at each evaluation, minutes to 80 %, mismatch KL between vLLM and
# the learner over the run). EXTRA="--learner.optim.lr 5e-5" adds flags to every run; WAIT_S (default 540) is how
# long to wait for the runs' summaries after they end.
set -uo pipefail
SET_NAME=${1:-learn}
OUT=${OUT:-runs/gpu_learn}
MINUTES=${MINUTES:-7}
EXTRA=${EXTRA:-}
RUNS=$OUT/runs
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PY=${PY:-python3}
CONFIG=deploy/configs/gpu_learn.toml
TINY=()

setup_gpu() {
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
  # Build the preset once (cached by content hash under ~/.cache/parallax), so the runs do not build it side by side.
  timeout 300 $PY -m policy build --preset learn-230m > "$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; exit 4; }
}

setup_cpu() {  # the same runs on CPU, tiny: mechanics only
  PY=${PY_CPU:-.venv/bin/python}
  MINUTES=${MINUTES_CPU:-4}
  TINY=(--learner.gpus "" --generator.gpus "" --preset tiny --threads 1 --task.train 64 --task.test 8
        --task.image-size 112 --warm-start.steps 3 --warm-start.batch 4 --warm-start.thought look
        --learner.algo.groups-per-step 2 --learner.eval.every 2 --generator.sampling.n 4
        --generator.sampling.max-tokens 24 --generator.engine.dtype float32 --generator.engine.kv-cache-gb 0.25
        --reward.workers 1)
}

launch() {  # launch NAME INDEX FLAGS...: one launcher run in the background, its ports offset by 10 x INDEX
  local name=$1 i=$2; shift 2
  local ports=(--reward.metrics.port $((9101 + 10 * i)) --generator.metrics.port $((9201 + 10 * i))
               --learner.metrics.port $((9301 + 10 * i)))
  local cmd=(timeout -s INT -k 60 $((MINUTES * 60 + 120)) $PY -m deploy --config "$CONFIG" --run-dir "$RUNS/$name"
             --progress plain --max-minutes "$MINUTES" "${ports[@]}" "$@" "${TINY[@]}")
  # shellcheck disable=SC2206
  cmd+=($EXTRA)
  echo "=== $name: ${cmd[*]}" | tee "$RUNS/$name.log"
  "${cmd[@]}" >> "$RUNS/$name.log" 2>&1 &
}

finish() {  # finish NAME...: wait for the runs, then for their summary.json (at most WAIT_S seconds)
  local n deadline=$((SECONDS + ${WAIT_S:-540}))
  wait
  for n in "$@"; do
    while [ ! -f "$RUNS/$n/summary.json" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
    [ -f "$RUNS/$n/summary.json" ] || echo "$n: no summary.json (see $RUNS/$n.log)"
  done
}

report() {  # report SET NAME...: one plot and one JSON over the set's runs
  local set=$1; shift
  local dirs=() n
  for n in "$@"; do dirs+=("$RUNS/$n"); done
  $PY -m deploy.plot "${dirs[@]}" --labels "$@" --out "$OUT/$set.png" --summary "$OUT/$set.json" \
    --title "learn-230m, colour code 1-4 on one GPU ($set)" > "$OUT/$set.plot.log" 2>&1 || tail "$OUT/$set.plot.log"
  $PY - "$OUT/$set.json" <<'PY'
import json, sys
for label, s in json.load(open(sys.argv[1])).items():
    every = max(1, len(s["evals"]) // 12)
    evals = " ".join(f"{e['minutes']}:{e['accuracy']:.2f}" for e in s["evals"][::every])
    print(f"{label:>10}: {s['outcome']}, {s['steps']} steps, best {s['best_eval_accuracy']}, "
          f"80% at {s['minutes_to_target']} min, mismatch KL mean {s['mismatch_kl']['mean']}; evals {evals}")
PY
}

run_flags() {  # run_flags NAME: the flags a run name stands for, "_" between parts (e.g. lr1e-4_kl0.3)
  local part
  for part in ${1//_/ }; do
    case "$part" in
      learn) ;;                                              # the config as it is
      control) echo --task.shuffle-images ;;                 # the same with images shuffled among prompts
      lr*) echo --learner.optim.lr "${part#lr}" ;;           # another learning rate
      kl*) echo --learner.loss.kl-coef "${part#kl}" ;;       # another KL coefficient
      *) echo --learner.loss.correction.type "$part" ;;      # none | decoupled | tis | icepop
    esac
  done
}

declare -A SET=([learn]="learn control" [corrections]="none decoupled tis icepop" [all]="learn control none tis icepop"
                [seq]="learn control" [lr]="learn lr5e-5 control" [sweep]="learn lr1e-4 control")
case "$SET_NAME" in
  cpu) setup_cpu; SET_NAME=${2:-learn} ;;
  learn|corrections|all|seq|lr|sweep) setup_gpu ;;
  *) echo "usage: $0 learn|corrections|all|seq|lr|sweep|cpu SET"; exit 2 ;;
esac
[ -n "${SET[$SET_NAME]:-}" ] || { echo "unknown set $SET_NAME (${!SET[*]})"; exit 2; }
read -ra NAMES <<< "${SET[$SET_NAME]}"
if [ "$SET_NAME" = seq ]; then  # the learning run alone until STOP_ACCURACY (or MINUTES), then the control for
  start=$SECONDS                # what is left of MINUTES (at least CONTROL_MIN minutes)
  EXTRA="$EXTRA --stop-accuracy ${STOP_ACCURACY:-0.9}" launch learn 0
  wait
  MINUTES=$(( MINUTES - (SECONDS - start) / 60 ))
  [ "$MINUTES" -ge "${CONTROL_MIN:-4}" ] || MINUTES=${CONTROL_MIN:-4}
  launch control 1 --task.shuffle-images
else
  i=0
  for n in "${NAMES[@]}"; do
    launch "$n" $i $(run_flags "$n")
    i=$((i + 1))
  done
fi
finish "${NAMES[@]}"
report "$SET_NAME" "${NAMES[@]}"
