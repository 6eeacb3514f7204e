"""Publish each scored group once, whoever delivers it and however often (idempotent by group id).

Streams deliver at least once: a group can come back after a worker died, stalled past the
reclaim idle time, or failed to publish. `OnceGate` keeps one small value per group id
(`<namespace>:reward:scored:<group_id>`) that moves through

    absent --claim (set-if-absent)--> "claim <consumer> <unix time>" --publish--> "done"
                                                   \\--publish failed--> "free"

A worker publishes only while holding the claim and acks only after "done" is stored, so a crash
between claim and "done" never loses a group: the claim goes stale after `stale_s` (or at once
for "free" and for the same consumer) and the next delivery takes it over. A duplicate can only
come from a worker that stalls for more than `stale_s` between claiming and publishing (a live holder
waiting on backpressure renews its claim, `renew`, so only a stalled one loses it).

`stale_s` must run out before the delivery is dead-lettered (RewardConfig.dead_letter_s): the other
workers that get the delivery while the claim stands leave it pending (BUSY), and each such delivery
counts towards `max_deliveries`. A claim that outlived them all would leave a worker frozen between
claim and publish, then killed, holding the only copy of the group.

Set-if-absent uses `Transport.set_value_nx(key, value, ttl_s=...)` when the transport has it (an
atomic SET NX with expiry on Redis); otherwise a read-then-write, which narrows but does not close
the race between two workers holding the same delivery at the same moment. `ttl_s` only applies
where set-if-absent supports it; plain `set_value` keeps "done" markers (tens of bytes a group).
"""

from __future__ import annotations

import time
from enum import Enum

from broker.names import Names
from broker.transport import Transport

DONE = b"done"
FREE = b"free"


class Claim(Enum):
    MINE = "mine"
    """This worker may publish now."""
    DONE = "done"
    """Already published: ack the delivery and move on."""
    BUSY = "busy"
    """Another live worker holds the claim: leave the delivery pending."""


def scored_key(names: Names, group_id: str) -> str:
    """Key of a group's publish state (proposed for broker.names as `Names.reward_scored`)."""
    builder = getattr(names, "reward_scored", None)
    return builder(group_id) if builder is not None else f"{names.namespace}:reward:scored:{group_id}"


class OnceGate:
    """Claim / finish / release of a group's single publication; see the module docstring."""

    def __init__(
        self,
        transport: Transport,
        names: Names,
        consumer: str,
        *,
        stale_s: float = 60.0,
        ttl_s: float | None = 7 * 24 * 3600.0,
    ) -> None:
        self.transport = transport
        self.names = names
        self.consumer = consumer
        self.stale_s = stale_s
        self.ttl_s = ttl_s

    def is_done(self, group_id: str) -> bool:
        return self.transport.get_value(scored_key(self.names, group_id)) == DONE

    def claim(self, group_id: str) -> Claim:
        key = scored_key(self.names, group_id)
        mine = f"claim {self.consumer} {time.time():.3f}".encode()
        if self._set_nx(key, mine):
            return Claim.MINE
        state = self.transport.get_value(key)
        if state == DONE:
            return Claim.DONE
        if state is None or self._stale(state):
            self.transport.set_value(key, mine)
            return Claim.MINE
        return Claim.BUSY

    def renew(self, group_id: str) -> None:
        """Stamp this worker's claim with the time now (it is still publishing, e.g. under backpressure)."""
        self._set(scored_key(self.names, group_id), f"claim {self.consumer} {time.time():.3f}".encode())

    def finish(self, group_id: str) -> None:
        self._set(scored_key(self.names, group_id), DONE)

    def release(self, group_id: str) -> None:
        """Give the claim back (publishing failed) so that the next delivery may take it."""
        self._set(scored_key(self.names, group_id), FREE)

    def _stale(self, state: bytes) -> bool:
        parts = state.decode(errors="replace").split(" ")
        if len(parts) != 3 or parts[0] != "claim":
            return True  # FREE or unreadable
        _, holder, stamp = parts
        try:
            age = time.time() - float(stamp)
        except ValueError:
            return True
        return holder == self.consumer or age > self.stale_s

    def _set_nx(self, key: str, value: bytes) -> bool:
        set_nx = getattr(self.transport, "set_value_nx", None)
        if set_nx is not None:
            return bool(set_nx(key, value, ttl_s=self.ttl_s))
        if self.transport.get_value(key) is not None:
            return False
        self.transport.set_value(key, value)
        return True

    def _set(self, key: str, value: bytes) -> None:
        self.transport.set_value(key, value)
