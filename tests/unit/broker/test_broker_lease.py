"""Leases, fenced writes and hand-back, on both transports (real redis-server, real ZeroMQ broker).

A lease is taken once at a time, each taking with the next epoch; a holder named dead is replaced; a
transport fenced with an epoch that is no longer the lease's has every write refused (FencedError) and
changes nothing; `release` gives a consumer's pending entries to another consumer at once, their
delivery counts unchanged.
"""

from __future__ import annotations

import time

import pytest

from broker.lease import Lease
from broker.transport import FencedError


def test_a_lease_is_held_once_and_each_taker_gets_the_next_epoch(connect, names):
    key = names.learner_lease
    first, second = Lease(connect(), key, b"first", ttl_s=30), Lease(connect(), key, b"second", ttl_s=30)
    assert first.acquire().acquired and first.epoch == 1
    refused = second.acquire()
    assert (refused.acquired, refused.epoch, refused.holder) == (False, 1, b"first")
    assert not second.acquire(replace=b"someone else").acquired  # only the exact holder found is replaced
    taken = second.acquire(replace=b"first")  # the caller knows `first` is dead
    assert taken.acquired and second.epoch == 2
    assert not first.renew() and first.lost.is_set()
    assert second.renew()
    second.release()
    third = Lease(connect(), key, b"third", ttl_s=30)
    assert third.acquire().acquired and third.epoch == 3


def test_an_expired_lease_is_renewed_when_nobody_took_it_and_lost_when_somebody_did(connect, names):
    lease = Lease(connect(), names.learner_lease, b"me", ttl_s=0.05)
    assert lease.acquire().acquired
    time.sleep(0.2)  # expired
    assert lease.renew() and not lease.lost.is_set()  # nobody took it: renewed, same epoch
    lease.ttl_s = 0.05
    assert lease.renew()
    time.sleep(0.2)
    other = Lease(connect(), names.learner_lease, b"other", ttl_s=30)
    assert other.acquire().acquired and other.epoch == lease.epoch + 1
    assert not lease.renew() and lease.lost.is_set()


def test_a_fenced_transport_writes_nothing_once_its_lease_moved_on(connect, names):
    key = names.learner_lease
    old = Lease(connect(), key, b"old", ttl_s=30)
    assert old.acquire().acquired
    writer, reader = connect(), connect()
    writer.fence = old.fence
    writer.ensure_group(names.scored, "learner")
    reader.publish(names.scored, b"group")
    got = writer.consume(names.scored, "learner", "learner-0", count=5, block_s=0.5)
    assert [d.payload for d in got] == [b"group"]
    writer.set_value(names.feeder_cursor, b"cursor-1")
    writer.check_fence()
    writer.publish_many(names.prompts, [b"p0"], keys=["k0"])
    writer.publish(names.prompts, b"p1")

    assert Lease(connect(), key, b"new", ttl_s=30).acquire(replace=b"old").acquired  # the lease is stolen
    backlog = reader.backlog(names.prompts)
    for write in (
        lambda: writer.publish(names.prompts, b"p2"),
        lambda: writer.publish_many(names.prompts, [b"p3"], keys=["k1"]),
        lambda: writer.ack(names.scored, "learner", [got[0].id]),
        lambda: writer.dead_letter(got[0], "learner", "test"),
        lambda: writer.set_value(names.feeder_cursor, b"cursor-2"),
        lambda: writer.consume(names.scored, "learner", "learner-0", count=5, block_s=0.2),
        writer.check_fence,
    ):
        with pytest.raises(FencedError):
            write()
    assert reader.backlog(names.prompts) == backlog
    assert reader.pending(names.scored, "learner") == 1  # not acked, not dead-lettered
    assert reader.get_value(names.feeder_cursor) == b"cursor-1"


def test_a_blocked_fenced_consume_is_refused_when_the_lease_moves_on(connect, names):
    old = Lease(connect(), names.learner_lease, b"old", ttl_s=30)
    assert old.acquire().acquired
    writer = connect()
    writer.fence = old.fence
    writer.ensure_group(names.scored, "learner")
    assert writer.consume(names.scored, "learner", "learner-0", block_s=0.05) == []
    Lease(connect(), names.learner_lease, b"new", ttl_s=30).acquire(replace=b"old")
    connect().publish(names.scored, b"late")
    with pytest.raises(FencedError):
        writer.consume(names.scored, "learner", "learner-0", block_s=1.0)


def test_released_entries_go_to_another_consumer_at_once_with_their_counts(connect, names):
    t = connect(claim_idle_s=600)
    t.ensure_group(names.prompts, "generators")
    for i in range(3):
        t.publish(names.prompts, f"p{i}".encode())
    held = t.consume(names.prompts, "generators", "gen-a", count=2, block_s=0.5)
    assert len(held) == 2
    assert t.release(names.prompts, "generators", "gen-a") == 2
    other = connect(claim_idle_s=600)
    got = other.consume(names.prompts, "generators", "gen-b", count=3, block_s=0.5)
    assert [d.payload for d in got] == [b"p0", b"p1", b"p2"]  # the handed-back ones first
    assert all(d.attempts == 1 for d in got)
    assert t.release(names.prompts, "generators", "gen-a") == 0
    assert t.release(names.prompts, "nobody", "gen-a") == 0
