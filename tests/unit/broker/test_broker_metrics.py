"""broker.metrics: the broker's series exist from the start, the backlog is read at scrape time."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

import broker
from broker import codec
from broker.channel import Publisher, Subscriber
from broker.metrics import BacklogCollector, broker_metrics
from broker.transport import TransportError
from runtime.metrics import new_registry
from tests.unit.broker.messages import rollout_group


@pytest.fixture
def transport(broker_url):
    t = broker.connect(broker_url)
    yield t
    t.close()


def test_a_subscriber_exports_its_stream_from_the_start(transport, names):
    registry = new_registry()
    Subscriber(transport, names.rollouts, "g", "c", registry=registry)
    for reason in (*codec.REASONS, "redelivery_cap"):
        labels = {"stream": names.rollouts, "reason": reason}
        assert registry.get_sample_value("parallax_broker_rejected_total", labels) == 0.0
    assert registry.get_sample_value("parallax_broker_stream_backlog", {"stream": names.rollouts}) == 0.0
    assert registry.get_sample_value("parallax_broker_backlog_errors_total") == 0.0
    text = generate_latest(registry).decode()
    assert f'parallax_broker_stream_backlog{{stream="{names.rollouts}"}} 0.0' in text


def test_backlog_follows_the_stream(transport, names):
    registry = new_registry()
    sub = Subscriber(transport, names.rollouts, "g", "c", registry=registry)
    broker_metrics(registry).backlog.cache_s = 0.0
    Publisher(transport, names.rollouts).publish_many([rollout_group("a"), rollout_group("b")])
    assert registry.get_sample_value("parallax_broker_stream_backlog", {"stream": names.rollouts}) == 2.0
    sub.ack([d for d, _ in sub.poll(count=2, block_s=0.5)])
    assert registry.get_sample_value("parallax_broker_stream_backlog", {"stream": names.rollouts}) == 0.0


class FlakyTransport:
    """backlog() returns the next value of `values`, raising the ones that are exceptions."""

    def __init__(self, *values):
        self.values = list(values)
        self.calls = 0

    def backlog(self, stream: str) -> int:
        self.calls += 1
        value = self.values.pop(0)
        if isinstance(value, Exception):
            raise value
        return value


def samples(collector: BacklogCollector) -> dict[str, float]:
    return {s.labels["stream"]: s.value for fam in collector.collect() for s in fam.samples}


def test_backlog_is_cached_and_a_failed_read_keeps_the_last_value():
    now = [0.0]
    registry = new_registry()
    errors = broker_metrics(registry).backlog_errors
    collector = BacklogCollector(errors, cache_s=2.0, clock=lambda: now[0])
    transport = FlakyTransport(5, 7, TransportError("redis down"), 9)
    collector.watch("s", transport)
    assert list(collector.describe())[0].samples == [] and transport.calls == 0  # registering reads nothing
    assert samples(collector) == {"s": 5}
    now[0] = 1.0
    assert samples(collector) == {"s": 5} and transport.calls == 1  # within cache_s: not read again
    now[0] = 2.5
    assert samples(collector) == {"s": 7}
    now[0] = 5.0
    assert samples(collector) == {"s": 7}  # the failed read is counted, not raised
    assert registry.get_sample_value("parallax_broker_backlog_errors_total") == 1
    now[0] = 7.5
    assert samples(collector) == {"s": 9}


def test_a_stream_never_read_is_absent_not_zero():
    errors = broker_metrics(new_registry()).backlog_errors
    collector = BacklogCollector(errors, cache_s=0.0)
    collector.watch("s", FlakyTransport(TransportError("no broker")))
    assert samples(collector) == {}


def test_the_pipeline_exports_what_waits_for_generators_and_reward_workers(transport, names):
    from broker.metrics import watch_pipeline

    registry = new_registry()
    watch_pipeline(registry, transport, names)
    broker_metrics(registry).backlog.cache_s = 0.0
    for stream in (names.prompts, names.rollouts):
        transport.ensure_group(stream, names.GENERATORS if stream == names.prompts else names.REWARD)
    transport.publish_many(names.prompts, [b"p0", b"p1", b"p2"])
    transport.publish(names.rollouts, b"r0")
    transport.consume(names.prompts, names.GENERATORS, "gen-0", count=1, block_s=0.5)  # one taken

    def value(name, stream):
        return registry.get_sample_value(name, {"stream": stream})

    assert value("parallax_broker_stream_waiting", names.prompts) == 2.0
    assert value("parallax_broker_stream_backlog", names.prompts) == 3.0
    assert value("parallax_broker_stream_waiting", names.rollouts) == 1.0
