"""The learner's own prompt feeder driving training through a stand-in generator + reward worker.

The stand-in consumes `names.prompts`, waits (like a generator's admission gate) until the
learner's announced version reaches each prompt's `min_version`, and publishes scored groups
sampled "at" that version. With K = 1 the learner must never see a sample beyond the bound, and
an evaluation round must report accuracy per data source.
"""

import random
import threading
import time

import broker
from broker import codec
from broker.channel import Publisher, Subscriber
from broker.config import BrokerConfig
from broker.names import group_id
from broker.schemas import PromptRecord, Rollout, RolloutGroup, Score, ScoredGroup
from learner.config import LearnerConfig
from learner.trainer import Learner
from learner.wiring import NullSender
from tasks.prompt import render_prompt_ids
from tasks.synthetic import SyntheticConfig, write_task
from weights.config import WeightSenderConfig


class StandIn(threading.Thread):
    def __init__(self, url, names, processor):
        super().__init__(daemon=True)
        self.transport = broker.connect(url)
        self.names, self.processor = names, processor
        self.stop = threading.Event()
        self.admitted: list[tuple[int, int]] = []  # (min_version, version it was sampled at)
        self.rng = random.Random(0)

    def version(self) -> int:
        raw = self.transport.get_value(self.names.learner_version)
        return codec.decode(raw).version if raw else 0

    def run(self):
        sub = Subscriber(self.transport, self.names.prompts, "generators", "gen-0", expect=PromptRecord)
        pub = Publisher(self.transport, self.names.scored)
        while not self.stop.is_set():
            for delivery, record in sub.poll(count=1, block_s=0.2):
                while self.version() < record.min_version and not self.stop.is_set():
                    time.sleep(0.02)
                v = self.version()
                self.admitted.append((record.min_version, v))
                pub.publish(self._scored(record, v, group_id(record.prompt_id, delivery.id)))
                sub.ack([delivery])
        self.transport.close()

    def _scored(self, record, version, gid):
        prompt = render_prompt_ids(self.processor, record.problem, len(record.images))
        n = 1 if record.split != "train" else 4
        samples, scores = [], []
        for i in range(n):
            length = self.rng.randint(2, 6)
            samples.append(
                Rollout.of(
                    token_ids=[self.rng.randrange(30, 1000) for _ in range(length)],
                    logprobs=[-7.0] * length,
                    response_text="",
                    version_start=version,
                    version_end=version,
                    finish_reason="stop",
                )
            )
            acc = float(i % 2) if record.split == "train" else 1.0
            scores.append(Score(reward=acc, accuracy=acc, format=1.0))
        group = RolloutGroup(
            group_id=gid,
            prompt_id=record.prompt_id,
            data_source=record.data_source,
            prompt_token_ids=prompt,
            images=record.images,
            ground_truth=record.ground_truth,
            samples=samples,
            split=record.split,
        )
        return ScoredGroup(group=group, scores=scores)


def test_feeder_drives_training_within_the_staleness_bound(
    tiny_model_dir, tiny_processor, redis_server, names, tmp_path
):
    task = tmp_path / "task"
    write_task(SyntheticConfig(out=task, train=12, test=3, image_size=56))
    cfg = LearnerConfig(
        model=str(tiny_model_dir),
        broker=BrokerConfig(url=redis_server.url, namespace=names.namespace),
        run_dir=str(tmp_path / "run"),
        max_steps=4,
        weight_sync=WeightSenderConfig(enabled=False),
        idle_exit_s=20.0,
    )
    cfg.algo.groups_per_step, cfg.algo.max_staleness = 2, 1
    cfg.feeder.train_data = str(task)
    cfg.eval.every, cfg.eval.timeout_s, cfg.eval.at_start = 2, 20.0, True
    cfg.checkpoint.every = 0
    stand_in = StandIn(redis_server.url, names, tiny_processor)
    stand_in.start()
    learner = Learner(cfg, sender=NullSender())
    try:
        learner.train()
    finally:
        stand_in.stop.set()
        stand_in.join(timeout=5)
    assert learner.state.step == 4
    feeder = learner.inbox.feeder
    assert feeder.state.published <= 4 * 2 + feeder.ahead  # never more than `ahead` in flight
    assert all(v >= m for m, v in stand_in.admitted)
    lines = [
        __import__("json").loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert sum(x["stale_samples"] for x in lines) == 0
    assert all(x["staleness_max"] <= 1 for x in lines) and any("staleness_mean" in x for x in lines)
    assert all(x["version_spanning"] == 0 for x in lines if "staleness_mean" in x)  # batch-loop samples
    assert learner.registry.get_sample_value(
        "parallax_learner_staleness_bucket", {"le": "1.0"}
    ) == learner.registry.get_sample_value("parallax_learner_staleness_count")
    # The round started after step 2 finishes while step 4 is collected (its prompts queue behind it).
    assert any(x.get("eval/accuracy/synthetic") == 1.0 and x.get("eval/missing") == 0.0 for x in lines)
    assert any(x.get("eval/round") == 0.0 for x in lines)  # eval.at_start: round 0 before the first step
    learner.close()


def test_training_stops_once_an_evaluation_reaches_stop_accuracy(
    tiny_model_dir, tiny_processor, redis_server, names, tmp_path, caplog
):
    """The stand-in answers every held-out prompt right: the round at the start reaches 0.9, so the learner
    stops long before max_steps, as a finished run (`eval.stop_accuracy`)."""
    task = tmp_path / "task"
    write_task(SyntheticConfig(out=task, train=12, test=3, image_size=56))
    cfg = LearnerConfig(
        model=str(tiny_model_dir),
        broker=BrokerConfig(url=redis_server.url, namespace=names.namespace),
        run_dir=str(tmp_path / "run"),
        max_steps=40,
        weight_sync=WeightSenderConfig(enabled=False),
        idle_exit_s=20.0,
    )
    cfg.algo.groups_per_step, cfg.algo.max_staleness = 2, 1
    cfg.feeder.train_data = str(task)
    cfg.eval.every, cfg.eval.timeout_s, cfg.eval.at_start, cfg.eval.stop_accuracy = 2, 20.0, True, 0.9
    cfg.checkpoint.every = 0
    stand_in = StandIn(redis_server.url, names, tiny_processor)
    stand_in.start()
    learner = Learner(cfg, sender=NullSender())
    try:
        with caplog.at_level("INFO", logger="learner.trainer"):
            learner.train()
    finally:
        stand_in.stop.set()
        stand_in.join(timeout=5)
    assert 1 <= learner.state.step < 40
    assert learner._target_reached == 1.0
    assert "reached eval.stop_accuracy 0.900" in caplog.text
    learner.close()
