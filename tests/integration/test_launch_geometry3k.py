"""The reference command (`python -m deploy --config deploy/configs/qwen2_5_vl_7b_geometry3k.toml
--model DIR --task geometry3k --task.data-dir DIR`) end to end on CPU.

The checkpoint is the locally built tiny Qwen2.5-VL (the layout of a Hugging Face download: config,
safetensors, tokenizer, processor); the data is a Geometry3k-schema parquet fixture in the Hugging
Face layout (data/train-00000-of-00001.parquet, data/test-...). The GPU layout, the batch sizes and
the compile settings are overridden for CPU; everything else is the reference config. The run must
preprocess both splits as its task stage (skipping the bad row), train two steps with the KL
reference and the held-out evaluation, and leave the run directory a user expects.

A bad checkpoint and a missing GPU index fail before anything starts, with the fix in the message.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.geometry3k import image_item, problems, write_split

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "configs" / "qwen2_5_vl_7b_geometry3k.toml"
CPU_OVERRIDES = [
    "--learner.gpus", "",
    "--generator.gpus", "",
    "--broker", "zmq",
    "--threads", "1",
    "--max-minutes", "6",
    "--progress", "plain",
    "--learner.max-steps", "2",
    "--learner.algo.groups-per-step", "2",
    "--learner.algo.mini-batches", "1",
    "--learner.algo.no-dynamic-sampling",
    "--learner.parallel.compile", "",
    "--learner.parallel.checkpoint-mode", "full",
    "--learner.eval.every", "1",
    "--learner.metrics.port", "0",
    "--generator.metrics.port", "0",
    "--reward.metrics.port", "0",
    "--reward.workers", "1",
    "--generator.engine.dtype", "float32",
    "--generator.engine.enforce-eager",
    "--generator.engine.max-model-len", "1024",
    "--generator.engine.kv-cache-gb", "0.25",
    "--generator.sampling.n", "2",
    "--generator.sampling.max-tokens", "8",
]  # fmt: skip


def launch(args: list[str], timeout: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deploy", "--config", str(CONFIG), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def geo3k_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("geometry3k")
    bad = {"images": [image_item()], "problem": "<image>Find z.", "answer": None, "id": "bad"}
    write_split(root, "train", problems(6) + [bad])
    write_split(root, "test", problems(3, seed=1))
    return root


@pytest.mark.slow
@pytest.mark.vllm
def test_reference_command_runs_on_cpu(tiny_model_dir, geo3k_dir, tmp_path):
    run_dir = tmp_path / "run"
    args = ["--model", str(tiny_model_dir), "--task", "geometry3k", "--task.data-dir", str(geo3k_dir)]
    done = launch([*args, "--run-dir", str(run_dir), *CPU_OVERRIDES])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    train = json.loads((run_dir / "data" / "train" / "manifest.json").read_text())
    test = json.loads((run_dir / "data" / "test" / "manifest.json").read_text())
    assert train["records"] == {"train": 6} and train["skipped"] == {"missing_answer": 1}
    assert test["records"] == {"test": 3}
    steps = [json.loads(x) for x in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for s in steps if s.get("groups")) == 2
    assert any("eval/accuracy" in s for s in steps)
    assert any(s.get("kl_ref") is not None for s in steps)  # the reference config's KL term ran
    learner_cfg = json.loads((run_dir / "learner" / "config.learner.json").read_text())
    assert learner_cfg["loss"]["kl_coef"] == 0.01 and learner_cfg["optim"]["lr"] == 1e-6
    assert learner_cfg["feeder"]["test_data"] == str(run_dir / "data" / "test")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outcome"] == "max_steps" and summary["steps"] == 2
    for name in ("curve.png", "config.launcher.json", "configs/learner.toml", "events.jsonl"):
        assert (run_dir / name).is_file(), name


def test_a_checkpoint_that_is_not_qwen2_5_vl_stops_before_anything_starts(tmp_path, geo3k_dir):
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    run_dir = tmp_path / "run"
    args = [
        "--model",
        str(model),
        "--task",
        "geometry3k",
        "--task.data-dir",
        str(geo3k_dir),
        "--run-dir",
        str(run_dir),
    ]
    done = launch([*args, *CPU_OVERRIDES], timeout=120)
    assert done.returncode == 2
    assert "is a llama checkpoint" in done.stdout and "python -m policy build" in done.stdout
    assert json.loads((run_dir / "pids.json").read_text() if (run_dir / "pids.json").exists() else "{}") == {}


def test_a_gpu_index_that_does_not_exist_is_refused(tmp_path, tiny_model_dir, geo3k_dir):
    args = ["--model", str(tiny_model_dir), "--task", "geometry3k", "--task.data-dir", str(geo3k_dir)]
    done = launch(
        [
            *args,
            "--run-dir",
            str(tmp_path / "run"),
            *CPU_OVERRIDES,
            "--learner.gpus",
            "0",
            "--generator.gpus",
            "7",
        ],
        timeout=120,
    )
    assert done.returncode == 2
    assert "does not exist" in done.stdout and "pick indices from that list" in done.stdout
