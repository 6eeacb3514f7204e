"""python -m deploy.role_configs: the role configs of the launcher, which each role's own loader reads."""

from __future__ import annotations

import json

import pytest

from deploy import role_configs
from generator.config import GeneratorConfig
from learner.config import LearnerConfig
from reward_service.config import RewardConfig
from runtime.config import load_config

ARGS = ["--model", "/m", "--task-dir", "/d", "--broker-url", "redis://127.0.0.1:6390/0", "--namespace", "ns"]


def test_each_role_loads_the_config_written_for_it(tmp_path, monkeypatch):
    monkeypatch.delenv("PARALLAX_BROKER_URL", raising=False)
    assert role_configs.main(["--run-dir", str(tmp_path), *ARGS, "--learner.optim.lr", "1e-4"]) == 0
    configs = tmp_path / "configs"
    learner = load_config(LearnerConfig, ["--config", str(configs / "learner.toml")])
    generator = load_config(GeneratorConfig, ["--config", str(configs / "generator.toml")])
    reward = load_config(RewardConfig, ["--config", str(configs / "reward.toml")])
    assert learner.optim.lr == 1e-4, "a launcher flag reaches its role"
    assert learner.model == generator.model == "/m" and learner.feeder.test_data == "/d"
    for cfg in (learner, generator, reward):
        assert (cfg.broker.url, cfg.broker.namespace) == ("redis://127.0.0.1:6390/0", "ns")
    assert learner.run_dir == str(tmp_path / "learner") and reward.run_dir == str(tmp_path / "reward")
    assert generator.engine.kv_cache_gb > 0, "the CPU layout's KV cache, as python -m deploy gives it"
    assert json.loads((tmp_path / "config.launcher.json").read_text())["learner"]["optim"]["lr"] == 1e-4


@pytest.mark.parametrize("missing", [["--run-dir"], ["--model"]])
def test_the_run_directory_and_the_model_are_required(tmp_path, missing, capsys):
    args = ["--run-dir", str(tmp_path), *ARGS]
    i = args.index(missing[0])
    del args[i : i + 2]
    assert role_configs.main(args) == 2
    assert "--run-dir and --model are required" in capsys.readouterr().err


def test_a_gpu_layout_is_refused(tmp_path, capsys):
    assert role_configs.main(["--run-dir", str(tmp_path), *ARGS, "--learner.gpus", "0"]) == 2
    assert "python -m deploy" in capsys.readouterr().err
    assert not (tmp_path / "configs").exists()
