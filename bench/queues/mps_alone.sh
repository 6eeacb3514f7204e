#!/usr/bin/env bash
# Run one command as a client of its own CUDA MPS daemon, optionally capped at P % of the GPU's multiprocessors:
#
#   bash bench/queues/mps_alone.sh P COMMAND...      (P = 100: no cap; COMMAND stopped after MPS_ALONE_TIMEOUT_S, 360)
#
# For queue rows that put one process under MPS without the launcher (bench/queues/h100.txt, section 3: vLLM alone
# under the SM cap that gave NaN logprobs beside the learner). The launcher's own MPS handling is deploy/mps.py.
set -u
pct=$1; shift
pipe=$(mktemp -d /tmp/mps-alone.XXXXXX)
export CUDA_MPS_PIPE_DIRECTORY=$pipe CUDA_MPS_LOG_DIRECTORY=$pipe
nvidia-cuda-mps-control -d || exit 3
for _ in $(seq 100); do [ -S "$pipe/control" ] && break; sleep 0.1; done
[ -S "$pipe/control" ] || { echo "mps_alone: no MPS control socket in $pipe" >&2; exit 3; }
if [ "$pct" -lt 100 ]; then export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct; fi
timeout --kill-after=20 "${MPS_ALONE_TIMEOUT_S:-360}" "$@"   # within the row's own timeout: the daemon still quits
rc=$?
echo quit | nvidia-cuda-mps-control
rm -rf "$pipe"
exit $rc
