#!/usr/bin/env bash
# The GPU learning run through the launcher (deploy/configs/gpu_learn.toml), runs side by side on ONE GPU, each a
# full `python -m deploy` (its own broker, reward service, vLLM generator and learner sharing the GPU by CUDA IPC).
# Run from the repository root on the lent H200 with vLLM installed in /tmp/site and $OUT set; every call carries
# [".whl"] (tyro, rich, matplotlib and their dependencies for CPython 3.12: the image lacks them; fill it with
# `bash deploy/gpu_learn.sh wheels` here). Each call stays under 9 minutes (MINUTES per run, default 7).
#
#   bash deploy/gpu_learn.sh learn         # the learning run (correction decoupled) + its control (shuffled images)
#   bash deploy/gpu_learn.sh corrections   # correction none / decoupled / tis / icepop, four runs side by side
#   bash deploy/gpu_learn.sh all           # learn + control + none / tis / icepop: five runs side by side, one call
#   bash deploy/gpu_learn.sh lr            # learn (the config's lr) + learn at lr 5e-5 + the control, side by side
#   bash deploy/gpu_learn.sh sweep         # learn + learn at lr 1e-4 + the control, side by side
#   bash deploy/gpu_learn.sh seq           # the learning run alone on the GPU until 0.9 held out, then the control
#   bash deploy/gpu_learn.sh cpu [SET]     # a set (default learn) on CPU with the tiny override (for testing here)
#   bash deploy/gpu_learn.sh wheels        # (here, with network) download the wheels into .whl/
#
# A run longer than one device call (10 minutes): BACKGROUND=1 starts the call's runs in their own process
# sessions (setsid: they outlive the call while the machine stays warm) under RUNS (default /tmp/gpu_learn,
# which survives between calls; $OUT does not), and a later call collects them:
#   MINUTES=15 BACKGROUND=1 bash deploy/gpu_learn.sh seq   # returns at once; the runs go on
#   bash deploy/gpu_learn.sh collect seq                    # waits for them, then plots and reports
#
# Writes $OUT/runs/<name>/ (each launcher run directory: summary.json, curve.png, learner/metrics.jsonl, logs/),
# $OUT/<call>.png (held-out accuracy and reward over wall-clock minutes, all runs of the call) and $OUT/<call>.json
# (per run: accuracy at each evaluation, minutes to 80%, mismatch KL between vLLM and the learner over the run).
# EXTRA="--learner.optim.lr 5e-5" adds flags to every run of the call.
set -uo pipefail
MODE=${1:-learn}
OUT=${OUT:-/tmp/out}
MINUTES=${MINUTES:-7}
EXTRA=${EXTRA:-}
BACKGROUND=${BACKGROUND:-0}
RUNS=${RUNS:-$OUT/runs}
case "$BACKGROUND:$MODE" in 1:*|*:collect|*:seq-run) RUNS=${RUNS_BG:-/tmp/gpu_learn} ;; esac
mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0
PY=python3
CONFIG=deploy/configs/gpu_learn.toml
TINY=()

wheels_here() {  # CPython 3.12 manylinux wheels of what the launcher needs beyond the image and the vLLM bundle
  mkdir -p .whl
  local plat="" p
  for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64; do plat="$plat --platform $p"; done
  for p in tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1 rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 \
      pygments==2.21.0 matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 \
      pyparsing==3.3.3 python-dateutil==2.9.0.post0 six==1.17.0 tomli_w==1.2.0; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .whl "$p"
  done
  ls .whl
}

setup_gpu() {
  [ -d /tmp/site/vllm ] || { echo "vLLM is not installed in /tmp/site (install the bundle: bash .gpu/p3/install-on-device.sh .gpu/p3 after staging parts 1 and 2)"; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-deploy .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD:/tmp/site-deploy
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
  # Build the preset once (cached by content hash under ~/.cache/parallax), so the runs do not build it side by side.
  timeout 300 $PY -m policy build --preset learn-230m > "$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; exit 4; }
}

setup_cpu() {  # the same runs on CPU, tiny: mechanics only
  export PYTHONPATH=$PWD
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
  if [ "$BACKGROUND" = 1 ]; then
    setsid nohup "${cmd[@]}" >> "$RUNS/$name.log" 2>&1 < /dev/null &
  else
    "${cmd[@]}" >> "$RUNS/$name.log" 2>&1 &
  fi
}

finish() {  # finish NAME...: wait for the runs (their summary.json, or RUNS/NAME.log idle for 3 min), then copy logs
  local n deadline=$((SECONDS + ${WAIT_S:-540}))
  if [ "$BACKGROUND" = 1 ]; then echo "started in the background under $RUNS: $*"; exit 0; fi
  wait
  for n in "$@"; do
    while [ ! -f "$RUNS/$n/summary.json" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
    [ -f "$RUNS/$n/summary.json" ] || echo "$n: no summary.json yet (still running?)"
    cp "$RUNS/$n.log" "$OUT/" 2>/dev/null
  done
}

report() {  # report CALL NAME...: one plot and one JSON over the call's runs
  local call=$1; shift
  local dirs=() n
  for n in "$@"; do dirs+=("$RUNS/$n"); done
  $PY -m deploy.plot "${dirs[@]}" --labels "$@" --out "$OUT/$call.png" --summary "$OUT/$call.json" \
    --title "learn-230m, colour code 1-4 on one GPU ($call)" > "$OUT/$call.plot.log" 2>&1 || tail "$OUT/$call.plot.log"
  $PY - "$OUT/$call.json" <<'PY'
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
                [seq]="learn control" [lr]="learn lr5e-5 control"
                [sweep]="learn lr1e-4 control")
COLLECT=0
case "$MODE" in
  wheels) wheels_here; exit 0 ;;
  cpu) setup_cpu; MODE=${2:-learn}; export GL_CPU=1 ;;
  collect) COLLECT=1; MODE=${2:-learn}; export PYTHONPATH=/tmp/site:$PWD:/tmp/site-deploy ;;
  seq-run) COLLECT=2; MODE=seq
    if [ "${GL_CPU:-0}" = 1 ]; then setup_cpu; else export PYTHONPATH=/tmp/site:$PWD:/tmp/site-deploy; fi ;;
  learn|corrections|all|seq|lr|sweep) setup_gpu ;;
  *) echo "usage: $0 learn|corrections|all|seq|lr|sweep|cpu SET|wheels|collect SET"; exit 2 ;;
esac
[ -n "${SET[$MODE]:-}" ] || { echo "unknown set $MODE (${!SET[*]})"; exit 2; }
read -ra NAMES <<< "${SET[$MODE]}"
if [ "$COLLECT" = 2 ]; then  # seq, in its own session: the learning run alone on the GPU until it reaches
  # STOP_ACCURACY (or MINUTES), then the control for what is left of MINUTES (at least CONTROL_MIN minutes)
  start=$SECONDS
  BACKGROUND=0 EXTRA="$EXTRA --stop-accuracy ${STOP_ACCURACY:-0.9}" launch learn 0
  wait
  MINUTES=$(( MINUTES - (SECONDS - start) / 60 ))
  [ "$MINUTES" -ge "${CONTROL_MIN:-4}" ] || MINUTES=${CONTROL_MIN:-4}
  BACKGROUND=0 launch control 1 --task.shuffle-images
  wait
  exit 0
fi
if [ "$MODE" = seq ] && [ "$COLLECT" = 0 ]; then  # the same sequence, in the foreground or (BACKGROUND=1) in its own session
  if [ "$BACKGROUND" = 1 ]; then
    setsid nohup env RUNS_BG="$RUNS" bash "$0" seq-run > "$RUNS/seq.log" 2>&1 < /dev/null &
  else
    RUNS_BG="$RUNS" bash "$0" seq-run > "$RUNS/seq.log" 2>&1
  fi
elif [ "$COLLECT" = 0 ]; then
  i=0
  for n in "${NAMES[@]}"; do
    launch "$n" $i $(run_flags "$n")
    i=$((i + 1))
  done
fi
finish "${NAMES[@]}"
report "$MODE" "${NAMES[@]}"
mkdir -p "$OUT/runs"
for n in "${NAMES[@]}"; do  # what comes back: the small files of each run directory, one tar per call
  cp -r "$RUNS/$n" "$OUT/runs/" 2>/dev/null
done
for d in "$OUT"/runs/*/; do  # what does not come back: weights, images, caches
  rm -rf "$d"learner/checkpoints "$d"learner/hf "$d"warmstart/model "$d"data/images "$d"data/*/images "$d"generator/vllm-cache "$d"redis
done
find "$OUT/runs" -type f -size +16M -printf 'not returned (size): %p %s\n' -delete  # session 9's runs were 446 MB
tar czf "$OUT/runs.tar.gz" -C "$OUT" runs && rm -rf "$OUT/runs"  # at most 8 files come back, 2 folders deep
du -sh "$OUT"/*
