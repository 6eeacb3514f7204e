"""The tiny learner's config for tests against a real Redis: `learner_config(model_dir, redis_server,
names, run_dir, **dotted)` is two steps on the test's streams, weight sync off, and the settings named by
dotted paths (`**{"algo.groups_per_step": 1}`) set on top."""

from __future__ import annotations

from broker.config import BrokerConfig
from learner.config import LearnerConfig
from weights.config import WeightSenderConfig


def learner_config(model_dir, redis_server, names, run_dir, **dotted) -> LearnerConfig:
    cfg = LearnerConfig(
        model=str(model_dir),
        broker=BrokerConfig(url=redis_server.url, namespace=names.namespace),
        run_dir=str(run_dir),
        max_steps=2,
        weight_sync=WeightSenderConfig(enabled=False),
        idle_exit_s=3.0,
    )
    for key, value in dotted.items():
        obj = cfg
        *path, last = key.split(".")
        for part in path:
            obj = getattr(obj, part)
        setattr(obj, last, value)
    return cfg
