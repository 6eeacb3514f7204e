"""`[metrics] sinks` of the learner, in TOML, on `python -m learner` and on `python -m deploy`: each tracker
chosen by name with its own table; a missing package or an online W&B run without a key is one line."""

import pytest

from deploy.plan import LaunchConfig
from learner.config import LearnerConfig
from runtime.config import load_config, to_dict
from trackers import config as trackers_config


@pytest.fixture
def installed(monkeypatch):
    """Every tracker package counts as installed (what validate() checks), whatever this venv holds."""
    monkeypatch.setattr(trackers_config, "installed", lambda module: True)


def test_sinks_and_their_tables_in_toml_and_flags(tmp_path, installed):
    toml = tmp_path / "learner.toml"
    toml.write_text(
        '[metrics]\nport = 9301\nsinks = ["tensorboard", "wandb"]\n'
        '[metrics.wandb]\nproject = "geo"\ntags = ["a"]\n[metrics.tensorboard]\ndir = "/data/tb"\n'
    )
    cfg = load_config(LearnerConfig, ["--config", str(toml), "--metrics.wandb.name", "r1"])
    assert cfg.metrics.sinks == ["tensorboard", "wandb"] and cfg.metrics.port == 9301
    assert (cfg.metrics.wandb.project, cfg.metrics.wandb.name, cfg.metrics.wandb.tags) == ("geo", "r1", ["a"])
    assert cfg.metrics.wandb.mode == "offline" and cfg.metrics.tensorboard.dir == "/data/tb"


def test_deploy_passes_sinks_to_the_learner(installed):
    cfg = load_config(
        LaunchConfig, ["--learner.metrics.sinks", "wandb", "--learner.metrics.wandb.tags", "x", "y"]
    )
    assert cfg.learner.metrics.sinks == ["wandb"] and cfg.learner.metrics.wandb.tags == ["x", "y"]
    assert cfg.learner.metrics.port == 9301  # the demo's Prometheus port is kept
    assert LaunchConfig().learner.metrics.sinks == []  # nothing but metrics.jsonl unless asked


def test_an_unknown_sink_is_refused_naming_the_choices():
    with pytest.raises(SystemExit, match="tensorboard, wandb"):
        load_config(LearnerConfig, ["--metrics.sinks", "mlflow"])


@pytest.mark.parametrize(("sink", "package"), [("tensorboard", "tensorboardX"), ("wandb", "wandb")])
def test_a_sink_whose_package_is_missing_stops_the_run_with_one_line(monkeypatch, sink, package):
    monkeypatch.setattr(trackers_config, "installed", lambda module: module != package)
    with pytest.raises(SystemExit) as exc:
        load_config(LearnerConfig, ["--metrics.sinks", sink])
    message = str(exc.value)
    assert "\n" not in message and f"needs the {package} package: pip install {package}==" in message


def test_online_wandb_needs_the_api_key_from_the_environment(monkeypatch, installed):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    argv = ["--metrics.sinks", "wandb", "--metrics.wandb.mode", "online"]
    with pytest.raises(SystemExit, match="WANDB_API_KEY"):
        load_config(LearnerConfig, argv)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    cfg = load_config(LearnerConfig, argv)
    assert "k" * 40 not in str(to_dict(cfg))  # the key is no config field: never in a resolved config
    load_config(LearnerConfig, ["--metrics.wandb.mode", "online"])  # not asked for: no key needed
