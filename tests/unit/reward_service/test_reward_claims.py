"""The publish claim runs out before its group can be dead-lettered: a worker frozen between claim and
publish, then killed, cannot take the group with it; a live holder under backpressure keeps its claim."""

from __future__ import annotations

import pytest

import reward_service.dedupe as dedupe
from broker.config import BrokerConfig
from broker.names import Names
from reward_service.config import RewardConfig
from reward_service.dedupe import Claim, OnceGate
from tests.unit.reward_service.test_reward_outbox import MemoryTransport


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(dedupe, "time", fake)
    return fake


@pytest.mark.parametrize(
    "cfg",
    [RewardConfig(), RewardConfig(broker=BrokerConfig(claim_idle_s=600.0, max_deliveries=5))],
    ids=["defaults", "fault suite"],
)
def test_a_frozen_workers_claim_is_taken_over_before_the_last_delivery(cfg, clock):
    cfg.validate()
    transport, names = MemoryTransport(), Names("t")
    frozen = OnceGate(transport, names, "w-0", stale_s=cfg.claim_stale_s)
    other = OnceGate(transport, names, "w-1", stale_s=cfg.claim_stale_s)
    assert frozen.claim("g") is Claim.MINE  # ... then SIGSTOP, and later SIGKILL
    clock.now += min(cfg.broker.claim_idle_s, cfg.claim_stale_s) - 1.0
    assert other.claim("g") is Claim.BUSY  # a delivery to another worker while the claim stands
    clock.now += cfg.dead_letter_s - 1.0  # just before the soonest last delivery: the claim ran out
    assert other.claim("g") is Claim.MINE  # taken over: published, not dead-lettered


def test_a_claim_that_outlives_the_deliveries_is_refused():
    with pytest.raises(ValueError, match="claim_stale_s"):
        RewardConfig(claim_stale_s=300.0).validate()  # the old default: 150 s of deliveries, 300 s of claim
    assert RewardConfig().dead_letter_s == 4 * 30.0 - 2 * 10.0


def test_a_live_holder_under_backpressure_renews_its_claim(clock):
    transport, names = MemoryTransport(), Names("t")
    holder = OnceGate(transport, names, "w-0", stale_s=60.0)
    other = OnceGate(transport, names, "w-1", stale_s=60.0)
    assert holder.claim("g") is Claim.MINE
    for _ in range(10):  # ten minutes of a full scored stream, retried every 5 s: renewed each time
        clock.now += 55.0
        holder.renew("g")
        assert other.claim("g") is Claim.BUSY
