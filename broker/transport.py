"""The one small transport interface that every Parallax process talks through.

A transport offers four things:
  * durable streams with consumer groups: `publish`, `consume`, `ack`, `dead_letter`;
    a delivery is acked only after it was processed, entries pending on a dead consumer are
    reclaimed by live ones, and an entry delivered more than `max_deliveries` times is moved
    to the stream's dead-letter stream (`consume` says how many in `Deliveries.capped`). `publish` blocks
    (backpressure) while a stream holds
    `max_len` unconsumed entries and raises `BackpressureTimeout` when that lasts too long:
    unconsumed work is never trimmed silently.
  * a content-addressed blob store for image bytes (`put_blob` / `get_blob`), with expiry.
  * a tiny latest-value store (`set_value` / `get_value`) for version announcements.
  * idempotent publishing: `publish_many(..., keys=[...])` gives each entry a key, and an entry
    whose key was published before (within `PUBLISH_KEY_TTL_S`) is not appended again: the call
    returns the id it got the first time, in the same atomic step as the appends. A producer that
    died after a publish and before recording its ids publishes the same entries again under the
    same keys and gets the original ids back (the learner's prompt feeder does).
  * leases with epochs (`acquire_lease` / `renew_lease` / `release_lease`) and fenced writes: a
    transport whose `fence` is set has every publish, consume, ack, dead letter and `set_value`
    checked on the broker, atomically with the write, against the lease's current epoch; once
    another holder took the lease they raise `FencedError` and change nothing (broker/lease.py).
  * hand-back: `release(stream, group, consumer)` makes a consumer's pending entries claimable by
    the group's other consumers at once, without counting a failed delivery (a generator that is
    stopped hands back what it holds instead of letting it wait for `claim_idle_s`).

Implementations: `broker.redis_transport.RedisTransport` (Redis Streams) and
`broker.zmq_transport.ZmqTransport` (a small ZeroMQ broker process with credit-based flow
control). Use `broker.connect(url)` to get one; nothing outside `broker/` imports redis or zmq.
Typed messages go through `broker.channel` on top of this byte-level interface.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from broker.stream_options import StreamOptions

PUBLISH_KEY_TTL_S = 7 * 24 * 3600.0
"""How long the broker remembers the id of an entry published with a key."""


class TransportError(RuntimeError):
    """The broker could not be reached or answered with an error."""


class BackpressureTimeout(TransportError):
    """A publish waited longer than its timeout for consumers to catch up."""


class FencedError(TransportError):
    """A write of a lease holder whose lease another holder took: refused by the broker, nothing changed."""


FENCED = "FENCED"
"""How the broker's refusal of a fenced write starts (both transports)."""


@dataclass(frozen=True)
class Fence:
    """The lease a transport's writes are checked against: its key and the epoch this process holds."""

    key: str
    epoch: int

    @property
    def counter(self) -> str:
        """The key of the lease's epoch counter (it outlives the lease's expiry)."""
        return f"{self.key}:epoch"


@dataclass(frozen=True)
class LeaseState:
    """What `acquire_lease` found: `acquired` (this call took it), the lease's epoch and its holder."""

    acquired: bool
    epoch: int
    holder: bytes


@dataclass(frozen=True)
class Delivery:
    """One entry handed to a consumer; ack it (or dead-letter it) by `id`."""

    stream: str
    id: str
    payload: bytes
    attempts: int = 1
    """How many times this entry has been delivered, this time included."""


class Deliveries(list):
    """What `consume` returns: the deliveries (a list), plus `capped`, how many entries this call
    moved to `<stream>:dead` instead because they had been delivered `max_deliveries` times."""

    def __init__(self, deliveries=(), capped: int = 0):
        super().__init__(deliveries)
        self.capped = capped


def check_keys(payloads: Sequence[bytes], keys: Sequence[str] | None) -> None:
    """`publish_many`'s contract on `keys`: none, or one per payload."""
    if keys is not None and len(keys) != len(payloads):
        raise ValueError(f"{len(payloads)} payloads with {len(keys)} keys")


class Transport(abc.ABC):
    """Byte-level streams, blobs and values; see the module docstring for the guarantees."""

    options: StreamOptions
    """The stream options this transport was connected with (max_len, max_deliveries, ...)."""
    auth_key: bytes | None = None
    """The run's message key: `broker.channel` signs what it publishes and verifies what it consumes
    with it (broker/auth.py); None: no message authentication. Set by `broker.connect`."""
    fence: Fence | None = None
    """Set by a lease holder (broker/lease.py): its writes are refused once the lease moved on."""

    def publish(self, stream: str, payload: bytes, *, timeout: float | None = 30.0) -> str:
        """Append `payload` to `stream` and return its entry id; block while the stream is full."""
        return self.publish_many(stream, [payload], timeout=timeout)[0]

    @abc.abstractmethod
    def publish_many(
        self,
        stream: str,
        payloads: Sequence[bytes],
        *,
        timeout: float | None = 30.0,
        keys: Sequence[str] | None = None,
    ) -> list[str]:
        """Publish in order, blocking while the stream is full; all ids, or BackpressureTimeout
        (whose `published` attribute lists the ids that did go out). With `keys` (one per
        payload), an entry whose key was published before is not appended again: its first id is
        returned (see the module docstring)."""

    @abc.abstractmethod
    def consume(
        self, stream: str, group: str, consumer: str, *, count: int = 1, block_s: float = 1.0
    ) -> Deliveries:
        """Return up to `count` entries for `consumer` of `group` (reclaimed ones first); entries
        past the redelivery cap found on the way are dead-lettered and counted in `.capped`."""

    @abc.abstractmethod
    def ack(self, stream: str, group: str, ids: Sequence[str]) -> None:
        """Mark entries as processed by `group`; they are never delivered to it again."""

    @abc.abstractmethod
    def dead_letter(self, delivery: Delivery, group: str, reason: str) -> None:
        """Move an entry to `<stream>:dead` with the reason and ack it."""

    @abc.abstractmethod
    def pending(self, stream: str, group: str) -> int:
        """Entries delivered to `group` but not yet acked."""

    @abc.abstractmethod
    def backlog(self, stream: str) -> int:
        """Entries in `stream` not yet acked by every group (what counts against `max_len`)."""

    @abc.abstractmethod
    def put_blob(self, key: str, data: bytes, *, ttl_s: float | None = None) -> None:
        """Store `data` under `key` (idempotent); refresh its expiry."""

    @abc.abstractmethod
    def get_blob(self, key: str) -> bytes | None:
        """The bytes stored under `key`, or None when absent or expired."""

    def get_blobs(self, keys: Sequence[str]) -> list[bytes | None]:
        """`get_blob` of each key, in order, in one round trip where the transport can (this default
        asks one by one)."""
        return [self.get_blob(key) for key in keys]

    @abc.abstractmethod
    def set_value(self, key: str, value: bytes) -> None:
        """Set a small latest-value entry."""

    @abc.abstractmethod
    def set_value_nx(self, key: str, value: bytes, *, ttl_s: float | None = None) -> bool:
        """Set `key` only if it is absent (atomically); True when this call set it.
        `ttl_s` makes the entry expire (the ZeroMQ broker keeps values for its lifetime)."""

    @abc.abstractmethod
    def get_value(self, key: str) -> bytes | None:
        """Read a latest-value entry (None when unset)."""

    @abc.abstractmethod
    def release(self, stream: str, group: str, consumer: str) -> int:
        """Hand `consumer`'s pending entries back to `group`: the next read of any other consumer reclaims
        them, and their delivery counts stay as they were; returns how many."""

    # ---- leases ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def acquire_lease(
        self, key: str, holder: bytes, ttl_s: float, *, replace: bytes | None = None
    ) -> LeaseState:
        """Take lease `key` for `holder` if it is free (or held by exactly `replace`, a holder known to be
        dead), with the epoch one above the last one handed out; else the current epoch and holder."""

    @abc.abstractmethod
    def renew_lease(self, key: str, epoch: int, holder: bytes, ttl_s: float) -> bool:
        """Extend the lease of `epoch` by `ttl_s` (recreating it if it expired and nobody took it since);
        False when another holder took it."""

    @abc.abstractmethod
    def release_lease(self, key: str, epoch: int) -> None:
        """Give the lease of `epoch` up (nothing happens when another holder has it)."""

    @abc.abstractmethod
    def check_fence(self) -> None:
        """Raise FencedError unless this transport's `fence` still holds (a round trip to the broker)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets/connections; idempotent."""

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
