"""The learner's metrics logger with each tracker on: TensorBoard's and W&B's files, read back with their
own readers, hold the series and steps of metrics.jsonl (held-out accuracy included); a tracker that fails
is dropped with one warning and training's metrics go on; a missing package is one line naming it."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from learner.config import LearnerConfig
from learner.metrics import LearnerMetrics
from runtime.config import to_dict
from tests.support.trackers import (
    jsonl_series,
    tensorboard_scalars,
    wandb_files,
    wandb_history,
    wandb_records,
    wandb_run,
)
from trackers.config import TrackedMetricsConfig, WandbConfig
from trackers.sinks import MissingPackage, Sinks

PASSWORD = "s3cret-pw"
API_KEY = "0123456789abcdef0123456789abcdef01234567"


def step_values(step: int) -> dict[str, float]:
    """One step's values as the learner logs them (learner/trainer.py), an evaluation every second step."""
    values = {
        "step": step, "version": step, "reward_mean": 0.25 * step, "accuracy": 0.1 * step,
        "kl": 0.01 / step, "mismatch_kl": 1e-4 * step, "staleness_mean": 0.5, "tokens_per_s": 1234.5 + step,
        "mfu": 0.31, "sync_s": 0.05 * step, "grad_norm": 1.5, "skipped/zero_variance": float(step),
        "mismatch_kl_fresh": float("nan") if step == 1 else 2e-4,  # no fresh sample: left out everywhere
    }  # fmt: skip
    if step % 2 == 0:
        values.update(
            {"eval/accuracy": 0.2 * step, "eval/accuracy/geometry3k": 0.2 * step, "eval/missing": 0}
        )
    return values


def log_steps(run_dir, cfg, steps, config=None) -> LearnerMetrics:
    metrics = LearnerMetrics(CollectorRegistry(), run_dir, cfg=cfg, config=config)
    for step in steps:
        metrics.log_step(step_values(step))
    metrics.close()
    return metrics


@pytest.fixture
def wandb_env(wandb_home, monkeypatch):
    """W&B's own files in the test's directory; a (fake) API key and a password on the command line."""
    monkeypatch.setenv("WANDB_API_KEY", API_KEY)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(sys, "argv", ["learner", "--broker.url", f"redis://:{PASSWORD}@redis:6379/0"])


def test_tensorboard_holds_the_series_and_steps_of_metrics_jsonl(tmp_path):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")
    log_steps(tmp_path, TrackedMetricsConfig(sinks=["tensorboard"]), range(1, 5))
    expected = jsonl_series(tmp_path)
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert set(scalars) == set(expected)
    assert "mismatch_kl_fresh" in scalars and "step" not in scalars
    for key, points in expected.items():
        assert [s for s, _ in scalars[key]] == [s for s, _ in points], key
        assert [v for _, v in scalars[key]] == pytest.approx([v for _, v in points], rel=1e-6), key
    assert scalars["eval/accuracy"] == [(2, pytest.approx(0.4)), (4, pytest.approx(0.8))]  # held out


def test_tensorboard_shows_each_step_once_after_a_restart_from_a_checkpoint(tmp_path):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")
    cfg = TrackedMetricsConfig(sinks=["tensorboard"])
    log_steps(tmp_path, cfg, [1, 2, 3])
    log_steps(tmp_path, cfg, [3, 4])  # restarted from the checkpoint of step 2
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tensorboard")["reward_mean"]] == [1, 2, 3, 4]


def test_wandb_offline_run_holds_the_series_of_metrics_jsonl_and_no_secret(tmp_path, wandb_env):
    cfg = TrackedMetricsConfig(
        sinks=["wandb"], wandb=WandbConfig(project="geo", name="run-a", tags=["x", "y"])
    )
    learner = LearnerConfig(run_dir=str(tmp_path), metrics=cfg)
    learner.broker.url = f"redis://:{PASSWORD}@redis:6379/0"
    log_steps(tmp_path, cfg, range(1, 5), config=to_dict(learner))
    (path,) = wandb_files(tmp_path)  # offline: under the run directory, nothing uploaded
    records = wandb_records(path)
    history, expected = wandb_history(records), jsonl_series(tmp_path)
    assert history == expected
    assert history["eval/accuracy/geometry3k"] == [(2, pytest.approx(0.4)), (4, pytest.approx(0.8))]
    run = wandb_run(records)
    assert (run.project, run.display_name, list(run.tags)) == ("geo", "run-a", ["x", "y"])
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["optim"]["lr"] == learner.optim.lr
    assert config["broker"]["url"] == "redis://:***@redis:6379/0"
    for file in (p for p in tmp_path.rglob("*") if p.is_file()):
        data = file.read_bytes()
        assert PASSWORD.encode() not in data and API_KEY.encode() not in data, file


def test_a_restarted_learner_goes_on_in_the_same_wandb_run(tmp_path, wandb_env):
    cfg = TrackedMetricsConfig(sinks=["wandb"])
    log_steps(tmp_path, cfg, [1, 2])
    log_steps(tmp_path, cfg, [3])
    first, second = (wandb_run(wandb_records(p)) for p in wandb_files(tmp_path))
    assert first.run_id == second.run_id == (tmp_path / "wandb" / "run_id").read_text().strip()
    assert first.display_name == tmp_path.name


def test_a_failing_tracker_is_dropped_with_one_warning_and_the_steps_go_on(tmp_path, caplog, monkeypatch):
    pytest.importorskip("tensorboardX")
    from trackers.tensorboard_sink import TensorBoardSink

    def disk_full(self, step, values, wall_time):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TensorBoardSink, "log", disk_full)
    metrics = LearnerMetrics(CollectorRegistry(), tmp_path, cfg=TrackedMetricsConfig(sinks=["tensorboard"]))
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            metrics.log_step(step_values(step))
    assert metrics.sinks.names == ["jsonl"]
    metrics.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "tensorboard" in warnings[0].getMessage()
    assert "No space left" in warnings[0].getMessage()
    assert [s for s, _ in jsonl_series(tmp_path)["reward_mean"]] == [1, 2, 3]


def test_a_tracker_that_cannot_start_is_dropped(tmp_path, caplog):
    pytest.importorskip("tensorboardX")
    (tmp_path / "not-a-dir").write_text("")
    cfg = TrackedMetricsConfig(sinks=["tensorboard"])
    cfg.tensorboard.dir = str(tmp_path / "not-a-dir" / "tb")
    sinks = Sinks.open(tmp_path, cfg)
    with caplog.at_level(logging.WARNING):
        sinks.log(step_values(1))
        sinks.log(step_values(2))
    assert sinks.names == ["jsonl"]
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_no_tracker_asked_for_imports_none(tmp_path):
    code = (
        "import sys; from learner.metrics import LearnerMetrics;"
        "from prometheus_client import CollectorRegistry;"
        "from trackers.config import TrackedMetricsConfig;"
        f"m = LearnerMetrics(CollectorRegistry(), {str(tmp_path)!r}, cfg=TrackedMetricsConfig());"
        "m.log_step({'step': 1, 'reward_mean': 0.5}); m.close();"
        "print(sorted(n for n in ('wandb', 'tensorboardX', 'tensorboard') if n in sys.modules))"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"
    assert (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize(("sink", "module"), [("tensorboard", "tensorboardX"), ("wandb", "wandb")])
def test_a_tracker_whose_package_is_missing_is_one_line_naming_it(tmp_path, monkeypatch, sink, module):
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(MissingPackage, match=f"needs the {module} package: pip install {module}=="):
        Sinks.open(tmp_path, TrackedMetricsConfig(sinks=[sink]))
