"""In-memory state of the ZeroMQ broker: streams, consumer groups, credits, blobs, values.

Pure Python, no sockets (the socket loop is `broker.zmq_broker`). Semantics match the Redis
transport: a consumer group starts at the stream's oldest retained entry; an entry is delivered
to one consumer of each group, stays pending until acked, is reclaimed by another consumer once
idle for `claim_idle_s`, and goes to the dead-letter list after `max_deliveries` deliveries. An
entry is dropped once every group acked it, so `len(entries)` is the backlog. `read_own` hands
a consumer its own pending entries again (what a restarted process asks for first). An entry
published with a key is appended once: a later publish under the same key returns its first id
(kept `PUBLISH_KEY_TTL_S`). Everything lives in this process's memory: a broker restart loses it.

Leases with epochs (broker/lease.py): `acquire_lease`, `renew_lease`, `release_lease` with the Redis
scripts' semantics (broker/redis_fence.py), and `fence_holds(key, epoch)`, which the broker checks before
it runs a fenced request. `release` hands a consumer's pending entries back to its group (the next
reclaim of any consumer takes them; their attempt counts stay).

Credit-based flow control: a producer may only publish with credits, and credits are granted
only while backlog + outstanding credits < max_len. Grants are leased (`CREDIT_LEASE_S`), so a
producer that dies holding credits gives them back by expiry.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field

from broker.transport import PUBLISH_KEY_TTL_S

DEAD_PAYLOAD_BYTES = 1024
"""A dead letter keeps this much of its payload (with its size), never the whole of it."""
CREDIT_LEASE_S = 10.0
"""Unused credits return to the pool this long after their last grant."""

# An entry is [payload, acks]; a pending record is [consumer, delivered_at, attempts].


@dataclass
class Group:
    last: int
    """Sequence number of the last entry delivered to this group."""
    pending: dict[int, list] = field(default_factory=dict)
    """seq -> [consumer, delivered_at, attempts], oldest delivery first."""


@dataclass
class Stream:
    entries: dict[int, list] = field(default_factory=dict)
    next_seq: int = 1
    groups: dict[str, Group] = field(default_factory=dict)
    credits: dict[bytes, list] = field(default_factory=dict)
    """client identity -> [count, expires_at]."""
    dead: deque = field(default_factory=lambda: deque(maxlen=100_000))
    """(id, payload prefix, reason, group, attempts, payload bytes), oldest first."""


class BrokerState:
    """Everything the broker holds; every method is one request's effect."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.streams: dict[str, Stream] = {}
        self.blobs: dict[str, tuple[bytes, float | None]] = {}
        self._blob_expiry: list[tuple[float, str]] = []
        self.values: dict[str, bytes] = {}
        self.published_keys: dict[str, tuple[str, float]] = {}
        """Publish key -> (entry id, expires at)."""
        self._key_expiry: deque[tuple[float, str]] = deque()  # (expires at, key), oldest first
        self.leases: dict[str, list] = {}
        """Lease key -> [epoch, holder, expires at]."""
        self.epochs: dict[str, int] = {}
        """Lease key -> the last epoch handed out (outlives the lease's expiry)."""

    def stream(self, name: str) -> Stream:
        s = self.streams.get(name)
        if s is None:
            s = self.streams[name] = Stream()
        return s

    # ---- credits and publishing ------------------------------------------------------------------
    def outstanding(self, s: Stream) -> int:
        now = self.clock()
        for client in [c for c, (_, exp) in s.credits.items() if exp <= now]:
            del s.credits[client]
        return sum(count for count, _ in s.credits.values())

    def grant(self, client: bytes, name: str, want: int, max_len: int) -> tuple[int, float]:
        """Grant up to `want` more credits; returns (client's credits now, lease seconds left)."""
        s = self.stream(name)
        room = max_len - len(s.entries) - self.outstanding(s)
        mine = s.credits.get(client)
        if room > 0 and want > 0:
            count = (mine[0] if mine else 0) + min(want, room)
            mine = s.credits[client] = [count, self.clock() + CREDIT_LEASE_S]
        return self.credits_of(client, name)

    def credits_of(self, client: bytes, name: str) -> tuple[int, float]:
        mine = self.streams[name].credits.get(client) if name in self.streams else None
        if not mine or mine[1] <= self.clock():
            return 0, 0.0
        return mine[0], mine[1] - self.clock()

    def release_credits(self, client: bytes, name: str) -> None:
        if name in self.streams:
            self.streams[name].credits.pop(client, None)

    def publish(
        self, client: bytes, name: str, payloads: list[bytes], keys: list[str] | None = None
    ) -> list[str] | None:
        """Append with the client's credits, skipping entries whose key was published before (their
        first id is returned); None (nothing appended) when it has too few credits for the rest."""
        s = self.stream(name)
        known = [self.published_id(k) for k in keys] if keys else [None] * len(payloads)
        if len(known) != len(payloads):
            raise ValueError(f"{len(payloads)} payloads with {len(known)} keys")
        new = sum(1 for id_ in known if id_ is None)
        have, _ = self.credits_of(client, name)
        if have < new:
            return None
        if new:
            s.credits[client][0] -= new
        expires = self.clock() + PUBLISH_KEY_TTL_S
        ids = []
        for i, (payload, id_) in enumerate(zip(payloads, known, strict=True)):
            if id_ is None:
                id_ = str(s.next_seq)
                s.entries[s.next_seq] = [payload, 0]
                s.next_seq += 1
                if keys:
                    self.published_keys[keys[i]] = (id_, expires)
                    self._key_expiry.append((expires, keys[i]))
            ids.append(id_)
        return ids

    def published_id(self, key: str) -> str | None:
        """The id of the entry published under `key` (None when none, or expired)."""
        item = self.published_keys.get(key)
        return item[0] if item is not None and item[1] > self.clock() else None

    # ---- consuming -------------------------------------------------------------------------------
    def ensure_group(self, name: str, group: str) -> Group:
        s = self.stream(name)
        g = s.groups.get(group)
        if g is None:
            first = next(iter(s.entries)) if s.entries else s.next_seq
            g = s.groups[group] = Group(last=first - 1)
        return g

    def consume(
        self, name: str, group: str, consumer: str, count: int, claim_idle_s: float, max_deliveries: int
    ) -> tuple[list[tuple[str, bytes, int]], int]:
        """Reclaimed idle entries first, then new ones: ([(id, payload, attempts)], how many idle
        entries went to the dead-letter list instead, past `max_deliveries`)."""
        s, g = self.stream(name), self.ensure_group(name, group)
        now = self.clock()
        out, capped = self._reclaim(s, g, group, consumer, count, now - claim_idle_s, max_deliveries)
        seq = g.last + 1
        while len(out) < count and seq < s.next_seq:
            entry = s.entries.get(seq)
            if entry is not None:
                g.pending[seq] = [consumer, now, 1]
                out.append((str(seq), entry[0], 1))
            g.last = seq
            seq += 1
        return out, capped

    def read_own(
        self, name: str, group: str, consumer: str, after: int, count: int, max_deliveries: int
    ) -> tuple[list[tuple[str, bytes, int]], int, int]:
        """`consumer`'s own pending entries after sequence number `after`, redelivered (the attempt
        counted, the idle clock restarted): ([(id, payload, attempts)], dead-lettered past the cap,
        entries looked at). Fewer than `count` looked at means there are no more."""
        s, g = self.stream(name), self.ensure_group(name, group)
        mine = sorted(seq for seq, record in g.pending.items() if record[0] == consumer and seq > after)
        mine = mine[:count]
        out, dead, now = [], [], self.clock()
        for seq in mine:
            record = g.pending[seq]
            if record[2] >= max_deliveries:
                dead.append(seq)
                continue
            g.pending[seq] = [consumer, now, record[2] + 1]
            out.append((str(seq), s.entries[seq][0], record[2] + 1))
        self._dead_letter_capped(s, g, group, dead, max_deliveries)
        return out, len(dead), len(mine)

    def _dead_letter_capped(self, s, g, group, seqs, max_deliveries) -> None:
        for seq in seqs:
            attempts = g.pending.pop(seq)[2]
            reason = f"delivered {attempts} times without ack (max_deliveries {max_deliveries})"
            payload = s.entries[seq][0]
            s.dead.append((str(seq), _prefix(payload), reason, group, attempts, len(payload)))
            self._acked(s, seq)

    def _reclaim(self, s, g, group, consumer, count, idle_before, max_deliveries):
        claim, dead = [], []
        for seq, record in g.pending.items():
            if record[1] > idle_before or len(claim) >= count:
                break
            (claim if record[2] < max_deliveries else dead).append(seq)
        self._dead_letter_capped(s, g, group, dead, max_deliveries)
        now = self.clock()
        for seq in claim:  # re-inserted at the end: pending stays ordered by delivery time
            g.pending[seq] = [consumer, now, g.pending.pop(seq)[2] + 1]
        return [(str(seq), s.entries[seq][0], g.pending[seq][2]) for seq in claim], len(dead)

    def release(self, name: str, group: str, consumer: str) -> int:
        """Hand `consumer`'s pending entries back (module docstring); returns how many."""
        s = self.streams.get(name)
        g = s.groups.get(group) if s else None
        if g is None:
            return 0
        mine = [seq for seq, record in g.pending.items() if record[0] == consumer]
        released = {seq: [consumer, float("-inf"), max(g.pending.pop(seq)[2] - 1, 0)] for seq in mine}
        g.pending = released | g.pending  # first in delivery order: the next reclaim takes them
        return len(mine)

    def ack(self, name: str, group: str, ids: list[str]) -> int:
        s = self.streams.get(name)
        g = s.groups.get(group) if s else None
        if g is None:
            return 0
        n = 0
        for id_ in ids:
            seq = int(id_)
            if g.pending.pop(seq, None) is not None:
                self._acked(s, seq)
                n += 1
        return n

    def _acked(self, s: Stream, seq: int) -> None:
        entry = s.entries[seq]
        entry[1] += 1
        if entry[1] >= len(s.groups):
            del s.entries[seq]

    def dead_letter(
        self, name: str, group: str, id_: str, payload: bytes, attempts: int, reason: str, nbytes: int = -1
    ) -> int:
        """Move a pending entry to the dead-letter list (`payload`: the part to keep; `nbytes`: its size)."""
        s = self.stream(name)
        g = s.groups.get(group)
        if g is None or int(id_) not in g.pending:
            return 0
        s.dead.append(
            (id_, _prefix(payload), reason, group, attempts, nbytes if nbytes >= 0 else len(payload))
        )
        return self.ack(name, group, [id_])

    def pending(self, name: str, group: str) -> int:
        s = self.streams.get(name)
        return len(s.groups[group].pending) if s and group in s.groups else 0

    def backlog(self, name: str) -> int:
        return len(self.streams[name].entries) if name in self.streams else 0

    def has_new(self, name: str, group: str) -> bool:
        s = self.streams.get(name)
        return s is not None and group in s.groups and s.groups[group].last + 1 < s.next_seq

    # ---- leases ----------------------------------------------------------------------------------
    def _lease(self, key: str) -> list | None:
        lease = self.leases.get(key)
        if lease is not None and lease[2] <= self.clock():
            del self.leases[key]
            return None
        return lease

    def acquire_lease(self, key: str, holder: bytes, ttl_s: float, replace: bytes | None) -> list:
        """[taken, epoch, holder]: taken when free or held by exactly `replace`, with the next epoch."""
        lease = self._lease(key)
        if lease is not None and (not replace or lease[1] != replace):
            return [False, lease[0], lease[1]]
        epoch = self.epochs[key] = self.epochs.get(key, 0) + 1
        self.leases[key] = [epoch, holder, self.clock() + ttl_s]
        return [True, epoch, holder]

    def renew_lease(self, key: str, epoch: int, holder: bytes, ttl_s: float) -> bool:
        """Extend the lease of `epoch` (recreated if it expired and nobody took it); False when lost."""
        if not self.fence_holds(key, epoch):
            return False
        lease = self._lease(key)
        self.leases[key] = [epoch, lease[1] if lease else holder, self.clock() + ttl_s]
        return True

    def release_lease(self, key: str, epoch: int) -> None:
        lease = self._lease(key)
        if lease is not None and lease[0] == epoch:
            del self.leases[key]

    def fence_holds(self, key: str, epoch: int) -> bool:
        """The lease (or, expired, its last epoch) is still `epoch`'s: its holder's writes may go ahead."""
        lease = self._lease(key)
        return (lease[0] if lease is not None else self.epochs.get(key, 0)) == epoch

    # ---- blobs and values -------------------------------------------------------------------------
    def put_blob(self, key: str, data: bytes, ttl_s: float | None) -> None:
        expires = None if ttl_s is None else self.clock() + ttl_s
        current = self.blobs.get(key)
        if current is not None and (current[1] is None or current[1] > self.clock()):
            data = current[0]  # stored once: only the expiry is refreshed
        self.blobs[key] = (data, expires)
        if expires is not None:
            heapq.heappush(self._blob_expiry, (expires, key))

    def get_blob(self, key: str) -> bytes | None:
        item = self.blobs.get(key)
        if item is None or (item[1] is not None and item[1] <= self.clock()):
            return None
        return item[0]

    def expire(self) -> None:
        """Drop expired blobs and publish keys."""
        now = self.clock()
        while self._blob_expiry and self._blob_expiry[0][0] <= now:
            _, key = heapq.heappop(self._blob_expiry)
            item = self.blobs.get(key)
            if item is not None and item[1] is not None and item[1] <= now:
                del self.blobs[key]
        while self._key_expiry and self._key_expiry[0][0] <= now:  # one fixed ttl: expiry order
            _, key = self._key_expiry.popleft()
            item = self.published_keys.get(key)
            if item is not None and item[1] <= now:
                del self.published_keys[key]


def _prefix(payload):
    """The first DEAD_PAYLOAD_BYTES of a payload (a zmq.Frame or bytes), as bytes."""
    data = payload.buffer if hasattr(payload, "buffer") else payload
    return bytes(data[:DEAD_PAYLOAD_BYTES])
