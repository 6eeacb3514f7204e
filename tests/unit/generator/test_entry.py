"""`python -m generator` argument handling: config layering, engines per GPU group, child commands."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from generator.__main__ import child_args, engine_groups
from generator.config import GeneratorConfig
from runtime.config import load_config

ROOT = Path(__file__).resolve().parents[3]


def test_flags_override_the_shipped_toml(monkeypatch):
    monkeypatch.setenv("PARALLAX_BROKER_URL", "redis://:pw@envhost:6379/0")
    cfg = load_config(
        GeneratorConfig,
        [
            "--config",
            str(ROOT / "deploy/configs/generator.toml"),
            "--model",
            "/m",
            "--sampling.n",
            "8",
            "--engine.max-model-len",
            "1024",
        ],
    )
    assert cfg.model == "/m" and cfg.sampling.n == 8 and cfg.engine.max_model_len == 1024
    assert cfg.sampling.temperature == 1.0 and cfg.engine.dtype == "bfloat16" and cfg.metrics.port == 9201
    assert cfg.broker.url == "redis://:pw@envhost:6379/0" and cfg.metrics.host == "127.0.0.1"


def test_one_engine_per_gpu_or_per_tp_group():
    assert engine_groups([6, 7], 1) == [[6], [7]]
    assert engine_groups([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert engine_groups([], 1) == []
    with pytest.raises(ValueError, match="do not split"):
        engine_groups([0, 1, 2], 2)


def test_children_get_their_own_gpu_id_port_seed_and_run_dir():
    argv = ["--gpus", "6-7", "--model", "/m", "--metrics.port", "9201", "--generator-id", "gen"]
    cfg = load_config(GeneratorConfig, argv)
    cmd = child_args(argv, cfg, 1, [7])
    assert cmd[:3] == [sys.executable, "-m", "generator"]
    child = load_config(GeneratorConfig, cmd[3:])  # later flags win
    assert (child.gpus, child.generator_id, child.metrics.port, child.engine.seed) == ("7", "gen-g7", 9202, 1)
    assert child.run_dir.endswith("g7") and child.model == "/m"


@pytest.mark.parametrize("make", ["missing", "not-a-checkpoint"])
def test_a_bad_model_path_is_named_instead_of_a_hub_error(tmp_path, make):
    from generator.__main__ import main

    path = tmp_path / "model"
    if make == "not-a-checkpoint":
        path.mkdir()
    reason = "no such directory" if make == "missing" else "no config.json"
    with pytest.raises(SystemExit, match=f"error: model {path}: .*{reason}"):
        main(["--model", str(path), "--run-dir", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


def test_a_wrong_type_in_the_toml_exits_1_naming_file_key_and_type(tmp_path):
    import subprocess

    bad = tmp_path / "generator.toml"
    bad.write_text('batch_prompts = 8\n[engine]\nmax_model_len = "4096"\n')
    out = subprocess.run(
        [sys.executable, "-m", "generator", "--config", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert f"error: {bad}: engine.max_model_len = '4096': expected int, got str" in out.stderr
    assert "Traceback" not in out.stderr
