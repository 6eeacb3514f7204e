"""The transport contract, run against both implementations (real redis-server, real ZeroMQ broker).

Every test runs once per `broker_url` kind: ack, no redelivery after ack, reclaim from a dead
consumer, a restarted consumer getting its own pending entries back at once, dead-letter after
max_deliveries, backpressure / credit flow control, two groups, poisoned entries between good
ones, blobs and values.
"""

from __future__ import annotations

import threading
import time

import pytest

from broker.channel import Publisher, Subscriber
from broker.schemas import RolloutGroup, WeightVersion
from broker.transport import BackpressureTimeout
from tests.unit.broker.messages import rollout_group

IDLE = 0.2  # claim_idle_s used by the reclaim tests


def test_publish_consume_ack(connect, names):
    t = connect()
    t.ensure_group(names.rollouts, "g")
    ids = [t.publish(names.rollouts, f"m{i}".encode()) for i in range(3)]
    assert len(set(ids)) == 3
    got = t.consume(names.rollouts, "g", "c1", count=10, block_s=0.5)
    assert [d.payload for d in got] == [b"m0", b"m1", b"m2"]
    assert [d.id for d in got] == ids
    assert all(d.attempts == 1 and d.stream == names.rollouts for d in got)
    assert t.pending(names.rollouts, "g") == 3
    t.ack(names.rollouts, "g", [d.id for d in got])
    assert t.pending(names.rollouts, "g") == 0
    assert t.backlog(names.rollouts) == 0


def test_a_keyed_publish_appends_each_key_once_and_returns_its_first_id(connect, names):
    t, again = connect(), connect()  # the repeat comes from another producer (a restarted process)
    t.ensure_group(names.prompts, "g")
    first = t.publish_many(names.prompts, [b"a", b"b"], keys=["k0", "k1"])
    repeat = again.publish_many(names.prompts, [b"a", b"b", b"c"], keys=["k0", "k1", "k2"])
    assert repeat[:2] == first and repeat[2] not in first
    got = t.consume(names.prompts, "g", "c1", count=10, block_s=0.5)
    assert [d.payload for d in got] == [b"a", b"b", b"c"] and [d.id for d in got] == repeat
    assert t.publish_many(names.prompts, [b"d"]) != t.publish_many(names.prompts, [b"d"])  # unkeyed: twice
    with pytest.raises(ValueError, match="keys"):
        t.publish_many(names.prompts, [b"e"], keys=["k3", "k4"])


def test_blocking_consume_wakes_on_publish(connect, names):
    consumer, producer = connect(), connect()
    consumer.ensure_group(names.rollouts, "g")
    timer = threading.Timer(0.2, producer.publish, args=(names.rollouts, b"late"))
    timer.start()
    got = consumer.consume(names.rollouts, "g", "c1", count=1, block_s=5.0)
    timer.join(timeout=5)
    assert [d.payload for d in got] == [b"late"]


def test_no_redelivery_after_ack(connect, names):
    t = connect(claim_idle_s=IDLE)
    t.ensure_group(names.rollouts, "g")
    t.publish(names.rollouts, b"once")
    first = t.consume(names.rollouts, "g", "c1", count=5, block_s=0.5)
    t.ack(names.rollouts, "g", [d.id for d in first])
    time.sleep(IDLE * 1.5)
    assert t.consume(names.rollouts, "g", "c2", count=5, block_s=0.1) == []
    assert connect(claim_idle_s=IDLE).consume(names.rollouts, "g", "c3", count=5, block_s=0.1) == []


def test_unacked_entry_of_a_dead_consumer_is_reclaimed(connect, names):
    dead = connect(claim_idle_s=IDLE)
    dead.ensure_group(names.rollouts, "g")
    for i in range(2):
        dead.publish(names.rollouts, f"job{i}".encode())
    taken = dead.consume(names.rollouts, "g", "dies", count=2, block_s=0.5)
    assert len(taken) == 2
    dead.close()  # the consumer dies without acking

    patient = connect(claim_idle_s=30)
    assert patient.consume(names.rollouts, "g", "patient", count=5, block_s=0) == []  # not idle for 30 s
    time.sleep(IDLE * 1.5)
    live = connect(claim_idle_s=IDLE)
    got = live.consume(names.rollouts, "g", "lives", count=5, block_s=0.1)
    assert sorted(d.payload for d in got) == [b"job0", b"job1"]
    assert all(d.attempts == 2 for d in got)
    live.ack(names.rollouts, "g", [d.id for d in got])
    assert live.pending(names.rollouts, "g") == 0
    assert live.backlog(names.rollouts) == 0


def test_a_restarted_consumer_gets_its_own_pending_entries_back_at_once(connect, names):
    before = connect(claim_idle_s=600)
    before.ensure_group(names.rollouts, "g")
    for i in range(5):
        before.publish(names.rollouts, f"job{i}".encode())
    held = before.consume(names.rollouts, "g", "worker-0", count=3, block_s=0.5)
    before.ack(names.rollouts, "g", [held[1].id])  # job1 done, job0 and job2 in progress
    before.close()  # the process dies holding job0 and job2

    other = connect(claim_idle_s=600)  # another consumer gets only new work, not worker-0's
    assert [d.payload for d in other.consume(names.rollouts, "g", "worker-1", count=1, block_s=0.5)] == [
        b"job3"
    ]
    after = connect(claim_idle_s=600)  # the restarted process, same consumer name
    first = after.consume(names.rollouts, "g", "worker-0", count=1, block_s=0.5)  # pages of `count`
    second = after.consume(names.rollouts, "g", "worker-0", count=5, block_s=0.5)
    assert [(d.payload, d.attempts) for d in first + second] == [(b"job0", 2), (b"job2", 2)]
    assert [d.id for d in first + second] == [held[0].id, held[2].id]
    rest = after.consume(names.rollouts, "g", "worker-0", count=5, block_s=0.5)
    assert [(d.payload, d.attempts) for d in rest] == [(b"job4", 1)]  # then new entries
    assert after.consume(names.rollouts, "g", "worker-0", count=5, block_s=0.1) == []  # re-read once
    after.ack(names.rollouts, "g", [d.id for d in first + second + rest])
    assert after.pending(names.rollouts, "g") == 1  # worker-1's job3


def test_own_pending_entries_past_the_redelivery_cap_are_dead_lettered(connect, names):
    for attempt in range(1, 4):  # a poison entry kills its consumer each time it is read
        t = connect(claim_idle_s=600, max_deliveries=2)
        if attempt == 1:
            t.ensure_group(names.rollouts, "g")
            t.publish(names.rollouts, b"poison")
        got = t.consume(names.rollouts, "g", "w", count=5, block_s=0.5)
        if attempt <= 2:
            assert [(d.payload, d.attempts) for d in got] == [(b"poison", attempt)]
        else:
            assert got == [] and got.capped == 1
        t.close()
    t = connect()
    assert [(d.payload, d.attempts) for d in t.dead_letters(names.rollouts)] == [(b"poison", 2)]
    assert t.pending(names.rollouts, "g") == 0 and t.backlog(names.rollouts) == 0


def test_dead_letter_after_max_deliveries(connect, names):
    t = connect(claim_idle_s=IDLE, max_deliveries=2)
    t.ensure_group(names.rollouts, "g")
    t.publish(names.rollouts, b"poison")
    t.publish(names.rollouts, b"fine")
    first = t.consume(names.rollouts, "g", "c1", count=2, block_s=0.5)
    t.ack(names.rollouts, "g", [first[1].id])  # only "fine" gets processed
    time.sleep(IDLE * 1.5)
    second = t.consume(names.rollouts, "g", "c2", count=5, block_s=0.1)
    assert [(d.payload, d.attempts) for d in second] == [(b"poison", 2)]
    time.sleep(IDLE * 1.5)
    third = t.consume(names.rollouts, "g", "c3", count=5, block_s=0.1)
    assert third == [] and third.capped == 1  # a third delivery is refused, and said so
    assert t.consume(names.rollouts, "g", "c3", count=5, block_s=0.1).capped == 0
    dead = t.dead_letters(names.rollouts)
    assert [(d.id, d.payload, d.group, d.attempts) for d in dead] == [(first[0].id, b"poison", "g", 2)]
    assert "max_deliveries" in dead[0].reason
    assert t.pending(names.rollouts, "g") == 0
    assert t.backlog(names.rollouts) == 0


@pytest.mark.parametrize("block_s", [0.0, 0.3])
def test_entries_past_the_redelivery_cap_are_counted_as_rejected(connect, names, block_s):
    from prometheus_client import CollectorRegistry

    t, registry = connect(claim_idle_s=IDLE, max_deliveries=2), CollectorRegistry()
    sub = Subscriber(t, names.rollouts, names.REWARD, "w1", expect=RolloutGroup, registry=registry)
    Publisher(t, names.rollouts).publish(rollout_group("crashes-its-worker"))
    for attempt in (1, 2):  # delivered, never acked (the worker "died" each time)
        got = sub.poll(count=5, block_s=0.5)
        assert [(m.group_id, d.attempts) for d, m in got] == [("crashes-its-worker", attempt)]
        time.sleep(IDLE * 1.5)
    assert sub.rejected_count("redelivery_cap") == 0
    producer = connect()
    publish_fine = threading.Timer(
        block_s / 3, Publisher(producer, names.rollouts).publish, args=(rollout_group("fine"),)
    )
    publish_fine.start()  # with block_s > 0 the poll reclaims, blocks, and wakes on "fine"
    publish_fine.join() if block_s == 0 else None
    got = sub.poll(count=5, block_s=block_s)
    publish_fine.join(timeout=5)
    assert [m.group_id for _, m in got] == ["fine"]
    sample = {"stream": names.rollouts, "reason": "redelivery_cap"}
    assert registry.get_sample_value("parallax_broker_rejected_total", sample) == 1
    assert sub.rejected_count() == 1  # the total over all reasons includes it
    assert [d.attempts for d in t.dead_letters(names.rollouts)] == [2]
    sub.ack([d for d, _ in got])
    assert t.backlog(names.rollouts) == 0


def test_publish_blocks_at_max_len_then_times_out_and_resumes_after_ack(connect, names):
    producer, consumer = connect(max_len=3), connect(max_len=3)
    consumer.ensure_group(names.rollouts, "g")
    for i in range(3):
        producer.publish(names.rollouts, f"m{i}".encode(), timeout=2)
    with pytest.raises(BackpressureTimeout):
        producer.publish(names.rollouts, b"overflow", timeout=0.3)
    assert producer.backlog(names.rollouts) == 3  # nothing trimmed, nothing lost

    result = {}
    blocked = threading.Thread(
        target=lambda: result.update(id=producer.publish(names.rollouts, b"m3", timeout=10))
    )
    blocked.start()
    time.sleep(0.3)
    assert blocked.is_alive() and not result  # still waiting for room
    got = consumer.consume(names.rollouts, "g", "c1", count=1, block_s=0.5)
    consumer.ack(names.rollouts, "g", [d.id for d in got])
    blocked.join(timeout=10)
    assert "id" in result
    rest = consumer.consume(names.rollouts, "g", "c1", count=10, block_s=0.5)
    assert [d.payload for d in got + rest] == [b"m0", b"m1", b"m2", b"m3"]


def test_slow_consumer_bounds_the_backlog_and_loses_nothing(connect, names):
    max_len, total = 5, 40
    producer, consumer = connect(max_len=max_len), connect(max_len=max_len)
    consumer.ensure_group(names.rollouts, "g")
    sent = [f"m{i}".encode() for i in range(total)]
    thread = threading.Thread(target=lambda: [producer.publish(names.rollouts, p, timeout=20) for p in sent])
    thread.start()
    received, peak = [], 0
    while len(received) < total:
        peak = max(peak, consumer.backlog(names.rollouts))
        got = consumer.consume(names.rollouts, "g", "slow", count=2, block_s=1.0)
        time.sleep(0.01)  # "processing"
        consumer.ack(names.rollouts, "g", [d.id for d in got])
        received += [d.payload for d in got]
    thread.join(timeout=10)
    assert received == sent
    assert peak <= max_len


def test_two_groups_each_see_every_entry(connect, names):
    t = connect()
    for group in ("reward", "audit"):
        t.ensure_group(names.rollouts, group)
    for i in range(5):
        t.publish(names.rollouts, f"m{i}".encode())
    a = t.consume(names.rollouts, "reward", "r1", count=10, block_s=0.5)
    t.ack(names.rollouts, "reward", [d.id for d in a])
    assert t.backlog(names.rollouts) == 5  # "audit" has not acked yet
    b = t.consume(names.rollouts, "audit", "a1", count=10, block_s=0.5)
    assert [d.payload for d in a] == [d.payload for d in b] == [f"m{i}".encode() for i in range(5)]
    t.ack(names.rollouts, "audit", [d.id for d in b])
    assert t.backlog(names.rollouts) == 0


def test_poisoned_entries_are_dead_lettered_and_counted_while_good_ones_arrive(connect, names):
    from prometheus_client import CollectorRegistry

    t, registry = connect(), CollectorRegistry()
    sub = Subscriber(t, names.rollouts, names.REWARD, "w1", expect=RolloutGroup, registry=registry)
    pub = Publisher(t, names.rollouts)
    pub.publish(rollout_group("good-1"))
    t.publish(names.rollouts, b"\x00\xffgarbage")
    t.publish(names.rollouts, _future_version_payload())
    pub.publish(WeightVersion(version=1, step=1))  # valid message, wrong stream
    pub.publish(rollout_group("good-2"))

    got = sub.poll(count=10, block_s=0.5)
    assert [m.group_id for _, m in got] == ["good-1", "good-2"]
    assert sub.rejected_count("malformed") == 1
    assert sub.rejected_count("unknown_version") == 1
    assert sub.rejected_count("wrong_type") == 1
    sample = {"stream": names.rollouts, "reason": "malformed"}
    assert registry.get_sample_value("parallax_broker_rejected_total", sample) == 1
    reasons = [d.reason for d in t.dead_letters(names.rollouts)]
    assert len(reasons) == 3 and "malformed" in reasons[0] and "schema_version" in reasons[1]
    sub.ack([d for d, _ in got])
    assert t.pending(names.rollouts, names.REWARD) == 0
    assert t.backlog(names.rollouts) == 0


def _future_version_payload() -> bytes:
    import msgspec

    raw = msgspec.to_builtins(rollout_group("from-the-future"))
    return msgspec.msgpack.encode(raw | {"schema_version": 999})


def test_blobs_round_trip_expire_and_values(connect, names):
    t = connect()
    key = names.blob("00" * 32)
    assert t.get_blob(key) is None
    t.put_blob(key, b"\x89PNG...", ttl_s=60)
    t.put_blob(key, b"\x89PNG...", ttl_s=60)  # idempotent
    assert t.get_blob(key) == b"\x89PNG..."
    short = names.blob("11" * 32)
    t.put_blob(short, b"gone soon", ttl_s=0.2)
    time.sleep(0.4)
    assert t.get_blob(short) is None

    # a batch: in order, None where absent or expired, duplicates answered each time
    assert t.get_blobs([key, short, names.blob("22" * 32), key]) == [b"\x89PNG...", None, None, b"\x89PNG..."]
    assert t.get_blobs([]) == []

    assert t.get_value(names.learner_version) is None
    t.set_value(names.learner_version, b"v1")
    t.set_value(names.learner_version, b"v2")
    assert t.get_value(names.learner_version) == b"v2"


def test_set_value_if_absent_is_first_writer_wins(connect, names):
    t = connect()
    key = names.reward_scored("g-1")
    assert t.set_value_nx(key, b"claim a") is True
    assert t.set_value_nx(key, b"claim b") is False
    assert t.get_value(key) == b"claim a"
    t.set_value(key, b"done")  # an explicit set still overwrites
    assert t.set_value_nx(key, b"claim c") is False and t.get_value(key) == b"done"
