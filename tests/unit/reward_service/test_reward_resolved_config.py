"""The reward service writes its resolved config into its run directory, as every role does."""

import json
from pathlib import Path

from deploy.plan import LaunchConfig, role_configs


def test_the_resolved_config_is_written_with_the_password_redacted(tmp_path, monkeypatch):
    import reward_service.__main__ as entry
    import reward_service.worker

    ran = []
    monkeypatch.setattr(reward_service.worker, "run_worker", lambda cfg, index: ran.append(cfg))
    argv = ["--run-dir", str(tmp_path / "reward"), "--broker.url", "redis://:hunter2@h:1/0", "--burst"]
    assert entry.main(argv) == 0
    text = (tmp_path / "reward" / "config.reward.json").read_text()
    assert "hunter2" not in text
    written = json.loads(text)
    assert written["broker"]["url"] == "redis://:***@h:1/0" and written["burst"] is True
    assert written["run_dir"] == str(tmp_path / "reward") and len(ran) == 1


def test_the_launcher_gives_the_reward_service_its_run_directory(tmp_path):
    configs = role_configs(LaunchConfig(), tmp_path, Path("/m"), Path("/d"), "zmq://127.0.0.1:1", "ns")
    assert configs["reward"].run_dir == str(tmp_path / "reward")
