"""The whole pipeline on one GPU through the launcher: learner and generator share it, weights by CUDA IPC.

What bench/gpu_smoke.py used to do by hand, now the way a user runs it: `python -m deploy` with the
one-GPU layout (`--learner.gpus 0 --generator.gpus 0`), the ZeroMQ broker (GPU hosts have no
redis-server), the `tiny-fullvocab` preset built locally, continuous batching with in-flight weight
updates, for 3 learner steps. Random weights score 0, so dynamic sampling is off: the run checks the
mechanics (steps, versions reaching the generator), not learning. The same command with
`--preset qwen2.5-vl-3b` (or `--model DIR`) and more steps is the pipeline measurement of
bench/README.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]

PIPELINE = [
    "--preset", "tiny-fullvocab",
    "--broker", "zmq",
    "--learner.gpus", "0",
    "--generator.gpus", "0",
    "--generator.engine.gpu-memory-utilization", "0.3",
    "--generator.continuous",
    "--generator.weight-update", "inflight",
    "--generator.sampling.n", "4",
    "--generator.sampling.max-tokens", "64",
    "--learner.max-steps", "3",
    "--learner.algo.groups-per-step", "4",
    "--learner.algo.no-dynamic-sampling",
    "--learner.eval.every", "0",
    "--learner.metrics.port", "0",
    "--generator.metrics.port", "0",
    "--reward.metrics.port", "0",
    "--reward.workers", "1",
    "--warm-start.steps", "0",
    "--task.train", "64",
    "--task.test", "4",
    "--progress", "plain",
    "--max-minutes", "6",
]  # fmt: skip


def test_the_launcher_runs_learner_and_generator_on_one_gpu(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "deploy", *PIPELINE, "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "max_steps" and summary["steps"] == 3
    steps = [json.loads(x) for x in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if s.get("groups")]
    assert len(trained) == 3
    assert max(s.get("version", 0) for s in steps) >= 2  # versions were published and training went on
