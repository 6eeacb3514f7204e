"""The launcher's plan (deploy/plan.py), progress folding (deploy/progress.py) and plots (deploy/plot.py).

No process is started here (the launcher itself: tests/integration/test_launcher.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import tomllib
from pathlib import Path

import pytest

from deploy.plan import LaunchConfig, role_configs, write_role_configs, write_toml
from deploy.plot import plot_runs, run_curve, smooth, summarize
from deploy.progress import JsonlTail, Rate, RunStatus
from generator.config import GeneratorConfig
from learner.config import LearnerConfig
from reward_service.config import RewardConfig
from runtime.config import load_config, validate

ROOT = Path(__file__).resolve().parents[3]


def test_demo_toml_is_the_embedded_default():
    shipped = load_config(LaunchConfig, ["--config", str(ROOT / "deploy" / "configs" / "demo.toml")])
    assert shipped == LaunchConfig()


def test_launcher_flags_reach_the_nested_role_configs():
    cfg = load_config(
        LaunchConfig,
        [
            "--learner.optim.lr",
            "1e-3",
            "--generator.sampling.n",
            "4",
            "--broker",
            "zmq",
            "--task.shuffle-images",
        ],
    )
    assert cfg.learner.optim.lr == 1e-3 and cfg.generator.sampling.n == 4
    assert cfg.broker == "zmq" and cfg.task.shuffle_images


def test_role_configs_round_trip_through_toml(tmp_path):
    cfg = LaunchConfig()
    cfg.learner.algo.temperature = 0.9
    configs = role_configs(cfg, tmp_path, Path("/models/m"), Path("/data/t"), "redis://127.0.0.1:7/0", "ns-1")
    paths = write_role_configs(configs, tmp_path)
    for name, cls in (("learner", LearnerConfig), ("generator", GeneratorConfig), ("reward", RewardConfig)):
        back = load_config(cls, ["--config", str(paths[name])])
        assert back == configs[name], name
        assert back.broker.url == "redis://127.0.0.1:7/0" and back.broker.namespace == "ns-1"
    learner, generator = configs["learner"], configs["generator"]
    assert learner.model == generator.model == "/models/m"
    assert learner.feeder.train_data == learner.feeder.test_data == "/data/t"
    assert (
        generator.sampling.temperature == 0.9
    )  # the learner's temperature, or the inbox rejects every group
    assert Path(learner.run_dir) == tmp_path / "learner"
    validate(learner)


def test_the_two_image_task_raises_the_generators_image_limit(tmp_path):
    cfg = load_config(LaunchConfig, ["--task.task", "more"])
    assert cfg.generator.engine.max_images == 1 and cfg.chance() == 0.5
    args = (tmp_path, Path("/m"), Path("/d"), "redis://127.0.0.1:7/0", "ns")
    assert role_configs(cfg, *args)["generator"].engine.max_images == 2
    assert role_configs(LaunchConfig(), *args)["generator"].engine.max_images == 1


def test_lora_on_the_learner_sets_the_generators_lora_serving(tmp_path):
    args = (tmp_path, Path("/m"), Path("/d"), "redis://127.0.0.1:7/0", "ns")
    engine = role_configs(LaunchConfig(), *args)["generator"].engine
    assert engine.max_lora_rank == 0  # full fine-tune: versions are full weights
    cfg = load_config(LaunchConfig, ["--learner.lora.rank", "12", "--learner.algo.max-staleness", "3"])
    engine = role_configs(cfg, *args)["generator"].engine
    assert (engine.max_lora_rank, engine.lora_slots, engine.lora_vision) == (
        16,
        4,
        False,
    )  # vLLM's ranks; K + 1
    cfg = load_config(LaunchConfig, ["--learner.lora.rank", "8", "--learner.lora.vision"])
    assert role_configs(cfg, *args)["generator"].engine.lora_vision


def test_write_toml_quotes_what_needs_quoting(tmp_path):
    data = {
        "a": 'say "hi"\\n',
        "flag": True,
        "xs": [1, 2.5],
        "t": {"odd key": 1, "sub": {"v": -3}},
        "none": None,
    }
    path = write_toml(tmp_path / "x.toml", data)
    back = tomllib.loads(path.read_text())
    assert back == {"a": 'say "hi"\\n', "flag": True, "xs": [1, 2.5], "t": {"odd key": 1, "sub": {"v": -3}}}
    with pytest.raises(TypeError):
        write_toml(tmp_path / "y.toml", {"obj": object()})


def test_jsonl_tail_returns_only_complete_new_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []  # not there yet
    path.write_text('{"step": 1}\n{"step": 2')
    assert tail.read() == [{"step": 1}]
    with open(path, "a") as f:
        f.write('}\nnot json\n{"step": 3}\n')
    assert tail.read() == [{"step": 2}, {"step": 3}]
    assert tail.read() == []


def test_run_status_folds_learner_lines():
    status = RunStatus()
    status.warm([{"step": 40, "steps": 40, "loss": 0.15}])
    status.learner(
        [
            {
                "step": 1,
                "groups": 8,
                "reward_mean": 0.3,
                "accuracy": 0.25,
                "staleness_mean": 0.5,
                "train_s": 2.0,
                "wait_s": 1.0,
                "sync_s": 0.1,
                "tokens_per_s": 1000.0,
                "skipped/zero_variance": 2.0,
            },
            {
                "step": 2,
                "groups": 8,
                "reward_mean": 0.5,
                "accuracy": 0.45,
                "eval/accuracy": 0.75,
                "eval/round": 0.0,
                "time": 10.0,
            },
        ]
    )
    assert status.step == 2 and status.reward == 0.5 and status.accuracy == 0.45
    assert status.staleness == 0.5 and status.step_s == pytest.approx(3.1)
    assert status.eval_accuracy == 0.75 and status.evals == [(10.0, 0, 0.75)]
    text = status.line()
    assert "held-out accuracy 0.750" in text and "warm-start 40/40" in text and "zero_variance 2" in text


def test_rate_is_per_second_over_the_window():
    rate = Rate(window_s=10)
    assert rate.value is None
    for t in range(0, 30, 2):
        rate.add(100.0 * t, now=float(t))
    assert rate.value == pytest.approx(100.0)
    assert rate.points[0][0] >= 28 - 10 - 2


def _fake_run(run_dir: Path, accuracies: list[float]) -> None:
    t0 = time.time()
    events = [
        {"time": t0, "event": "launch", "chance": 0.25},
        {"time": t0 + 1, "event": "stage", "stage": "warm-start"},
        {"time": t0 + 31, "event": "stage", "stage": "rl"},
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run_dir / "learner").mkdir(parents=True)
    lines = []
    for step in range(1, 41):
        line = {"time": t0 + 30 + 6 * step, "step": step, "groups": 8, "reward_mean": 0.2 + step / 80}
        if step % 10 == 0:
            line.update({"eval/accuracy": accuracies[step // 10 - 1], "eval/round": step - 10})
        lines.append(line)
    (run_dir / "learner" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_curve_summary_and_png(tmp_path):
    _fake_run(tmp_path, [0.25, 0.5, 0.84, 0.9])
    curve = run_curve(tmp_path, "demo")
    assert len(curve.reward) == 40 and curve.eval_acc == [0.25, 0.5, 0.84, 0.9]
    assert curve.stages["warm-start"] == (pytest.approx(1 / 60), pytest.approx(31 / 60))
    assert curve.chance == 0.25
    summary = summarize(curve, "time_limit", 0.8)
    assert summary["first_eval_accuracy"] == 0.25 and summary["best_eval_accuracy"] == 0.9
    assert summary["minutes_to_target"] == pytest.approx((30 + 6 * 30) / 60)
    assert summary["steps"] == 40
    assert summary["stages"]["rl"] == [0.52, None]  # still running at the end: no NaN in the JSON
    json.loads(json.dumps(summary), parse_constant=lambda c: pytest.fail(f"{c} in summary.json"))
    png = plot_runs([curve, dataclasses.replace(curve, label="control")], tmp_path / "curve.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smooth_is_a_trailing_mean():
    assert smooth([0, 2, 4, 6], window=2) == [0, 1, 3, 5]
    assert math.isnan(run_curve(Path("/nonexistent")).chance)


def test_the_task_stage_passes_every_synthetic_option_through(tmp_path):
    """The launcher's task stage runs `python -m tasks synthetic` with TaskOptions.synthetic_args: each option
    the launcher takes (none at its default here) reaches the task's own config."""
    from deploy.plan import TaskOptions
    from tasks.synthetic import SyntheticConfig

    options = TaskOptions(
        task="count", train=7, test=3, n_colours=1, colour_jitter=5, image_size=56, max_count=6,
        size_jitter=0.1, equal_area=True, shuffle_images=True, seed=11,
    )  # fmt: skip
    args = options.synthetic_args(tmp_path / "data")
    assert args[0] == "synthetic"
    parsed = load_config(SyntheticConfig, args[1:])
    for field in dataclasses.fields(TaskOptions):
        if hasattr(parsed, field.name):
            assert getattr(parsed, field.name) == getattr(options, field.name), field.name
    assert Path(parsed.out) == tmp_path / "data"
