"""The tiny learner on CPU with both trackers on: after `close()`, TensorBoard's event files and the
offline W&B run hold every series of metrics.jsonl at the same steps, and the run's config."""

import json

import pytest

from learner.trainer import Learner
from learner.wiring import NullSender
from tests.support.learner import learner_config
from tests.support.trackers import (
    jsonl_series,
    tensorboard_scalars,
    wandb_files,
    wandb_history,
    wandb_records,
    wandb_run,
)


def test_the_learner_logs_each_step_to_tensorboard_and_wandb(
    tiny_model_dir, redis_server, names, publish, tmp_path, wandb_home
):
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")
    run_dir = tmp_path / "run-7" / "learner"  # as python -m deploy lays it out
    cfg = learner_config(
        tiny_model_dir,
        redis_server,
        names,
        run_dir,
        **{"algo.groups_per_step": 1, "checkpoint.every": -1, "metrics.sinks": ["tensorboard", "wandb"]},
    )
    publish([1.0, 0.0, 0.5], seed=1)
    publish([0.0, 1.0], seed=2)
    learner = Learner(cfg, sender=NullSender())
    learner.train()
    learner.close()
    expected = jsonl_series(run_dir)
    assert {"reward_mean", "accuracy", "mismatch_kl", "tokens_per_s", "sync_s"} <= set(expected)
    assert [step for step, _ in expected["reward_mean"]] == [1, 2]
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert set(scalars) == set(expected)
    for key, points in expected.items():
        assert [s for s, _ in scalars[key]] == [s for s, _ in points], key
        assert [v for _, v in scalars[key]] == pytest.approx([v for _, v in points], rel=1e-5, abs=1e-30), key
    (path,) = wandb_files(run_dir)
    records = wandb_records(path)
    assert wandb_history(records) == expected
    run = wandb_run(records)
    assert run.display_name == "run-7"  # the run's name, not "learner"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["model"] == str(tiny_model_dir) and config["metrics"]["sinks"] == ["tensorboard", "wandb"]
