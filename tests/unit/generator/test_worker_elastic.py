"""A generator joining a running run serves only once it has the learner's current weights; one stopped
(SIGTERM) hands the prompts it holds back to the other generators at once; one that crashed keeps them for
its restart. Over a real redis-server and the ZeroMQ broker, with a stand-in engine (no vLLM)."""

from __future__ import annotations

import pytest

import broker
from broker import codec
from broker.channel import Publisher
from broker.config import BrokerConfig
from broker.names import Names
from broker.schemas import PromptRecord, WeightVersion
from generator.config import GeneratorConfig
from generator.worker import GeneratorWorker
from weights.config import WeightReceiverConfig


class Engine:
    """The parts of generator.engine.Engine the worker touches outside a generate call."""

    on_cpu = True
    tokenizer = None

    def __init__(self, version: int = 0):
        self.version = version

    def apply_weights(self, received, version: int, running: bool = False) -> float:
        self.version = version
        return 0.0

    def close(self) -> None:
        pass


class Receiver:
    """The weight receiver: version `version` arrives at the `after`-th poll."""

    def __init__(self, version: int, after: int):
        self.version, self.after, self.polls = version, after, 0

    def poll(self):
        self.polls += 1
        if self.polls != self.after:
            return None
        return type("Received", (), {"version": self.version, "seconds": 0.0, "num_bytes": 1})()

    def mark_served(self, version: int) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture
def transport(broker_url):
    t = broker.connect(broker_url, claim_idle_s=600)
    yield t
    t.close()


def _worker(transport, names, generator_id="gen-1", **kw) -> GeneratorWorker:
    cfg = GeneratorConfig(
        broker=BrokerConfig(namespace=names.namespace),
        generator_id=generator_id,
        weight_sync=WeightReceiverConfig(enabled=False, timeout_s=kw.pop("timeout_s", 30.0)),
        block_s=0.05,
        gate_poll_s=0.02,
        prepare_threads=0,
        **kw,
    )
    return GeneratorWorker(cfg, engine=Engine(), transport=transport)


def _prompt(i: int, min_version: int = 0) -> PromptRecord:
    return PromptRecord(
        prompt_id=f"p{i}",
        data_source="t",
        problem="?",
        ground_truth="1",
        min_version=min_version,
        split="train",
    )


def test_a_joining_generator_takes_no_prompt_before_it_serves_the_learners_version(transport, names):
    transport.set_value(names.learner_version, codec.encode(WeightVersion(version=3, source="learner")))
    worker = _worker(transport, names)
    worker.receiver = Receiver(version=3, after=4)
    seen = []

    def admit(count, block_s):
        seen.append(worker.engine.version)
        worker.stop()
        return []

    worker.admit_prompts = admit
    worker.run()
    assert seen == [3] and worker.receiver.polls >= 4
    served = codec.decode(transport.get_value(names.generator_version("gen-1")))
    assert served.version == 3  # announced once it serves the current weights


def test_a_joining_generator_serves_what_it_has_when_the_weights_do_not_come(transport, names):
    transport.set_value(names.learner_version, codec.encode(WeightVersion(version=3, source="learner")))
    worker = _worker(transport, names, timeout_s=0.2)
    worker.receiver = Receiver(version=3, after=10**9)  # the learner's rendezvous never answers
    worker.catch_up()
    assert worker.engine.version == 0 and worker.receiver.polls > 1


def test_a_stopped_generator_hands_its_prompts_back_at_once(transport, names):
    Publisher(transport, names.prompts).publish_many([_prompt(0), _prompt(1, min_version=5), _prompt(2)])
    worker = _worker(transport, names)
    admitted = worker.admit_prompts(3, 0.5)
    assert [r.prompt_id for _, r in admitted] == ["p0", "p2"] and worker.holding  # in flight; p1 held
    worker.stop()  # SIGTERM
    worker.close()
    other = broker.connect(transport_url(transport), claim_idle_s=600)
    try:
        got = other.consume(names.prompts, Names.GENERATORS, "gen-2", count=10, block_s=0.5)
    finally:
        other.close()
    assert len(got) == 3 and all(d.attempts == 1 for d in got)  # no failed delivery counted


def test_a_crashed_generator_keeps_its_prompts_for_its_restart(transport, names):
    Publisher(transport, names.prompts).publish_many([_prompt(0), _prompt(1)])
    worker = _worker(transport, names)
    assert len(worker.admit_prompts(2, 0.5)) == 2
    worker.close()  # no stop(): an exception took the loop down
    other = broker.connect(transport_url(transport), claim_idle_s=600)
    try:
        assert other.consume(names.prompts, Names.GENERATORS, "gen-2", count=10, block_s=0.2) == []
        restarted = other.consume(names.prompts, Names.GENERATORS, "gen-1", count=10, block_s=0.2)
    finally:
        other.close()
    assert [d.attempts for d in restarted] == [2, 2]


def transport_url(transport) -> str:
    return transport.url
