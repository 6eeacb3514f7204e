"""Settings and records shared by both transport implementations (Redis and ZeroMQ).

`StreamOptions` holds the knobs of the transport contract (bound, reclaim, redelivery cap,
blob expiry, byte caps); `broker.connect(url, **opts)` passes its keyword options through to it, and
each transport checks them (`validate`) when it is made. `BrokerConfig.validate` uses the same checks.
`OversizeError` is what a transport raises for an entry or blob above its cap.
`DeadLetter` is what `dead_letters(stream)` returns for inspection of a dead-letter stream.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1024 * 1024
OVERSIZE = "oversize"
"""The rejected-messages reason of an entry above `max_entry_bytes`."""


class OversizeError(ValueError):
    """An entry or blob larger than its cap (`StreamOptions.max_entry_bytes` / `max_blob_bytes`)."""

    reason = OVERSIZE


def check_size(what: str, nbytes: int, cap: int) -> None:
    """Raise OversizeError when `nbytes` exceeds `cap`."""
    if nbytes > cap:
        raise OversizeError(f"{what} of {nbytes:,} bytes is above the cap of {cap:,} bytes")


@dataclass(frozen=True)
class StreamOptions:
    """Contract knobs of a transport; the same meaning on Redis and on ZeroMQ."""

    max_len: int = 10_000
    """Backlog bound per stream (entries not yet acked by every group); publish blocks at it."""
    claim_idle_s: float = 30.0
    """An entry pending this long on one consumer is reclaimed by the next consumer that reads."""
    max_deliveries: int = 5
    """An entry delivered this many times without an ack goes to `<stream>:dead` instead of a 6th time."""
    blob_ttl_s: float | None = 24 * 3600.0
    """Expiry of blobs stored with `ttl_s=None`; None keeps them forever."""
    dead_max_len: int = 100_000
    """Dead-letter streams keep about this many of the newest entries (they are not work); the
    ZeroMQ broker keeps a fixed 100,000 per stream."""
    max_entry_bytes: int = 4 * MiB
    """Largest stream entry: a publish above it raises `OversizeError`, and a consumer dead-letters a
    larger entry unread (reason "oversize"). A rollout group of 16 samples x 8k tokens with logprobs
    and text is about 2 MB; images travel as blobs."""
    max_blob_bytes: int = 16 * MiB
    """Largest blob (an encoded image): larger ones are refused when stored and when fetched."""
    dead_payload_bytes: int = 1024
    """A dead letter keeps this much of its payload (its prefix) with its id, reason and size."""
    reconnect_s: float = 30.0
    """After a connection error (broker restarting, network blip) a call reconnects and retries
    with exponential back-off for this long before it raises `TransportError`; 0 fails at once."""

    def validate(self) -> None:
        """Raise ValueError naming the first option out of range."""
        if self.max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {self.max_len}")
        if self.max_deliveries < 1:
            raise ValueError(f"max_deliveries must be >= 1, got {self.max_deliveries}")
        if self.claim_idle_s <= 0:
            raise ValueError(f"claim_idle_s must be > 0, got {self.claim_idle_s}")
        for name in ("max_entry_bytes", "max_blob_bytes"):
            if getattr(self, name) < 1024:
                raise ValueError(f"{name} must be >= 1024, got {getattr(self, name)}")
        if self.dead_payload_bytes < 0:
            raise ValueError(f"dead_payload_bytes must be >= 0, got {self.dead_payload_bytes}")
        if self.reconnect_s < 0:
            raise ValueError(f"reconnect_s must be >= 0, got {self.reconnect_s}")


@dataclass(frozen=True)
class DeadLetter:
    """One entry of a dead-letter stream."""

    id: str
    """Entry id in the original stream."""
    payload: bytes
    """The first `StreamOptions.dead_payload_bytes` of the entry's payload."""
    reason: str
    group: str
    """Consumer group that gave up on it."""
    attempts: int
    nbytes: int = -1
    """Size of the whole payload (-1 when unknown)."""


class Backoff:
    """Sleep intervals for polling loops: start small, double up to `cap_s`."""

    def __init__(self, start_s: float = 0.001, cap_s: float = 0.05):
        self.start_s, self.cap_s, self.next_s = start_s, cap_s, start_s

    def reset(self) -> None:
        self.next_s = self.start_s

    def step(self) -> float:
        delay, self.next_s = self.next_s, min(self.next_s * 2, self.cap_s)
        return delay
