"""broker.channel: typed publish/poll/ack, `expect` unions, one counter per registry."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

import broker
from broker.channel import Publisher, Subscriber, rejected_counter
from broker.schemas import RolloutGroup, ScoredGroup, WeightVersion
from tests.unit.broker.messages import every_message, rollout_group


@pytest.fixture
def transport(broker_url):
    t = broker.connect(broker_url)
    yield t
    t.close()


def test_every_kind_travels_typed(transport, names):
    sub = Subscriber(transport, names.prompts, "g", "c")  # expects any message by default
    Publisher(transport, names.prompts).publish_many(every_message())
    got = sub.poll(count=10, block_s=0.5)
    assert [m for _, m in got] == every_message()
    sub.ack([d for d, _ in got])
    assert transport.pending(names.prompts, "g") == 0


def test_expect_accepts_a_union(transport, names):
    sub = Subscriber(transport, names.scored, "g", "c", expect=RolloutGroup | ScoredGroup)
    pub = Publisher(transport, names.scored)
    scored = every_message()[2]
    for msg in (rollout_group("a"), WeightVersion(version=1, step=1), scored):
        pub.publish(msg)
    got = [m for _, m in sub.poll(count=10, block_s=0.5)]
    assert got == [rollout_group("a"), scored]
    assert sub.rejected_count("wrong_type") == 1
    assert "expected RolloutGroup or ScoredGroup" in transport.dead_letters(names.scored)[0].reason


def test_subscribers_share_one_counter_per_registry(transport, names):
    registry = CollectorRegistry()
    a = Subscriber(transport, names.rollouts, "g", "a", registry=registry)
    b = Subscriber(transport, names.rollouts, "g", "b", registry=registry)
    assert a.rejected is b.rejected is rejected_counter(registry)
    assert Subscriber(transport, names.rollouts, "g", "c").rejected is not a.rejected  # private default
