"""Typed publish/subscribe on top of a byte-level `Transport`.

    pub = Publisher(transport, names.rollouts)
    pub.publish(group)                                   # blocks under backpressure
    sub = Subscriber(transport, names.rollouts, Names.REWARD, "worker-1", expect=RolloutGroup)
    for delivery, group in sub.poll(count=16, block_s=1.0):
        ...process...
    sub.ack([d for d, _ in batch])                       # ack only after processing

With a message key on the transport (`Transport.auth_key`, the run's secret), the publisher seals
every entry with an HMAC tag over the stream name and the encoded message (broker/auth.py), and the
subscriber checks, in this order and before decoding anything: the entry's size
(`StreamOptions.max_entry_bytes`, reason "oversize"), then its tag (reason "auth": a forged entry,
or one from another run, never reaches the role). A payload that does not decode (garbage, unknown
kind, unknown schema version) or is not one of the `expect`ed types is dead-lettered with its reason,
counted in
`parallax_broker_rejected_total{stream,reason}`, logged, and never returned; the good entries
around it are returned as usual. Entries the transport itself moved to the dead-letter stream
while consuming, because they had been delivered `max_deliveries` times without an ack, are
counted there too, with reason `redelivery_cap` (`Deliveries.capped`). A Subscriber also exports its
stream's backlog and pre-creates
its rejected counters (`broker.metrics.watch`). Nothing here creates a metrics registry at import
time: pass your process's registry, or each Subscriber counts into a private one.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry

from broker import codec
from broker.auth import AuthError, key_of, open_sealed, seal
from broker.metrics import REASONS, REDELIVERY_CAP, rejected_counter, watch
from broker.schemas import Message
from broker.stream_options import OVERSIZE, StreamOptions
from broker.transport import Delivery, Transport

log = logging.getLogger(__name__)


def _types_of(expect) -> tuple[type, ...]:
    """(A,) for A, (A, B) for A | B or (A, B)."""
    if isinstance(expect, types.UnionType):
        return expect.__args__
    return tuple(expect) if isinstance(expect, tuple) else (expect,)


class Publisher:
    """Encodes messages and publishes them to one stream."""

    def __init__(self, transport: Transport, stream: str):
        self.transport = transport
        self.stream = stream

    def publish(self, msg: Message, *, timeout: float | None = 30.0) -> str:
        """Publish one message; blocks while the stream is full (BackpressureTimeout after `timeout`)."""
        return self.transport.publish(self.stream, self._payload(msg), timeout=timeout)

    def publish_many(
        self, msgs: Iterable[Message], *, timeout: float | None = 30.0, keys: Sequence[str] | None = None
    ) -> list[str]:
        """Publish several messages in order, in as few round trips as the transport allows;
        `keys` makes it idempotent per message (`Transport.publish_many`)."""
        payloads = [self._payload(m) for m in msgs]
        return self.transport.publish_many(self.stream, payloads, timeout=timeout, keys=keys)

    def _payload(self, msg: Message) -> bytes:
        """The encoded message, sealed with the run's key (if the transport has one)."""
        return seal(key_of(self.transport), self.stream, codec.encode(msg))


class Subscriber:
    """Consumes one stream as `consumer` of `group`, decoding and type-checking every entry."""

    def __init__(
        self,
        transport: Transport,
        stream: str,
        group: str,
        consumer: str,
        *,
        expect: type | types.UnionType | tuple[type, ...] = Message,
        registry: CollectorRegistry | None = None,
    ):
        self.transport = transport
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.expect = _types_of(expect)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rejected = rejected_counter(self.registry)
        watch(self.registry, transport, stream)  # backlog gauge, rejected counters at 0 from the start
        ensure_group = getattr(transport, "ensure_group", None)
        if ensure_group is not None:  # join now, so nothing published from here on is missed
            ensure_group(stream, group)

    def poll(self, count: int = 1, block_s: float = 1.0) -> list[tuple[Delivery, Message]]:
        """Up to `count` (delivery, message) pairs; rejected entries are dead-lettered, not returned."""
        good = []
        deliveries = self.transport.consume(
            self.stream, self.group, self.consumer, count=count, block_s=block_s
        )
        capped = getattr(deliveries, "capped", 0)
        if capped:
            log.warning(
                "%s: %d entries delivered max_deliveries times without ack were dead-lettered",
                self.stream,
                capped,
            )
            self.rejected.labels(stream=self.stream, reason=REDELIVERY_CAP).inc(capped)
        for delivery in deliveries:
            try:
                msg = self._message(delivery.payload)
            except (codec.MessageError, AuthError) as exc:
                self.reject(delivery, exc.reason, str(exc))
                continue
            good.append((delivery, msg))
        return good

    def _message(self, payload: bytes) -> Message:
        """The message in a payload: size checked, then its tag, then decoded and type-checked."""
        options = getattr(self.transport, "options", None)
        cap = options.max_entry_bytes if options is not None else StreamOptions.max_entry_bytes
        if len(payload) > cap:
            raise codec.MessageError(OVERSIZE, f"{len(payload):,} bytes, above max_entry_bytes {cap:,}")
        msg = codec.decode(open_sealed(key_of(self.transport), self.stream, payload))
        if not isinstance(msg, self.expect):
            wanted = " or ".join(t.__name__ for t in self.expect)
            raise codec.MessageError("wrong_type", f"got {type(msg).__name__}, expected {wanted}")
        return msg

    def reject(self, delivery: Delivery, reason: str, detail: str = "") -> None:
        """Dead-letter one delivery with `reason` (a short label) and count it."""
        log.warning("%s: dead-lettering entry %s: %s", self.stream, delivery.id, detail or reason)
        self.transport.dead_letter(delivery, self.group, detail or reason)
        self.rejected.labels(stream=self.stream, reason=reason).inc()

    def ack(self, deliveries: Sequence[Delivery]) -> None:
        """Ack processed deliveries (never before processing them)."""
        self.transport.ack(self.stream, self.group, [d.id for d in deliveries])

    def rejected_count(self, reason: str | None = None) -> float:
        """How many entries this subscriber's counter holds for this stream (optionally one reason)."""
        reasons = [reason] if reason else REASONS
        labels = [{"stream": self.stream, "reason": r} for r in reasons]
        return sum(
            self.registry.get_sample_value("parallax_broker_rejected_total", lab) or 0.0 for lab in labels
        )
