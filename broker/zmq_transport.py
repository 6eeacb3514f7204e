"""ZeroMQ implementation of `broker.transport.Transport`: a client of `broker.zmq_broker`.

One DEALER socket per transport (not thread-safe: one transport per thread; a lock serialises
accidental sharing). Every call is one request-reply (see `broker.zmq_broker` for the framing).

Credit-based flow control: `publish` spends credits the broker granted for that stream; with
none left it asks for more (`credit_batch` at a time), and the broker parks that request while
the stream's backlog plus the credits it already handed out reach `max_len`. A producer thus
blocks until consumers ack, and gets `BackpressureTimeout` once `timeout` has passed.

Restarts and reconnects: the first `consume` of a (stream, group, consumer) re-reads that
consumer's own pending entries (`read_own`, page by page) before anything new, so a restarted
process with the same consumer name gets its unacked entries back at once. The socket has a
fixed identity and reconnects by itself (libzmq's back-off, 0.1 s doubling to 2 s); a request
that gets no answer within `request_timeout_s` is resent with the same request id (the broker
answers a repeat once: see `broker.zmq_broker`) after an exponential back-off, for up to
`reconnect_s`, then `TransportError`. A broker that restarted has lost its in-memory state.

With `fence` set (broker/lease.py) publish, consume, ack, dead letters and `set_value` go as fenced
requests (broker/zmq_broker.py): refused, they raise `FencedError`.

Credentials: the password in the URL (zmq://:PASSWORD@host:port; `BrokerConfig.connect_url` puts it
there) is presented on every connection (ZeroMQ PLAIN). A broker that refuses it closes the
connection; the transport sees that on its socket monitor and raises `TransportError` at once
instead of retrying. Entries and blobs above their caps (`StreamOptions.max_entry_bytes`,
`max_blob_bytes`) raise `OversizeError` before anything is sent.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Sequence

import msgspec
import zmq
import zmq.utils.monitor

from broker.stream_options import DeadLetter, StreamOptions, check_size
from broker.transport import (
    FENCED,
    BackpressureTimeout,
    Deliveries,
    Delivery,
    FencedError,
    LeaseState,
    Transport,
    TransportError,
    check_keys,
)
from runtime.redact import redact

PLAIN_USER = "parallax"
"""The ZeroMQ PLAIN user name (the broker's `broker.zmq_broker.PLAIN_USER`)."""
AUTH_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
"""Socket monitor events of a broker refusing this client's credentials (a wrong password; none at all)."""
CREDIT_WAIT_S = 1.0
"""Longest single credit request parked at the broker (the client re-asks until its timeout)."""
PUBLISH_CHUNK = 256
"""Most entries per publish request."""
FENCED_OPS = frozenset({"publish", "consume", "read_own", "ack", "dead", "set_value", "check_fence"})
"""Requests sent behind the lease's epoch check while the transport's `fence` is set."""


def endpoint_of(url: str) -> str:
    """zmq://[:password@]host:port -> tcp://host:port (tcp:// and ipc:// pass through)."""
    if url.startswith("zmq://"):
        return "tcp://" + url.removeprefix("zmq://").rpartition("@")[2].rstrip("/")
    if url.startswith(("tcp://", "ipc://")):
        return url
    raise ValueError(f"not a ZeroMQ broker url: {url!r} (expected zmq://host:port)")


class ZmqTransport(Transport):
    """Streams, blobs and values on a `broker.zmq_broker` process; see the module docstring."""

    def __init__(
        self,
        url: str = "zmq://127.0.0.1:5555",
        options: StreamOptions | None = None,
        *,
        request_timeout_s: float = 10.0,
        credit_batch: int = 64,
        **opts,
    ):
        self.options = options or StreamOptions(**opts)
        self.options.validate()
        self.url = url
        self.request_timeout_s = request_timeout_s
        self.credit_batch = credit_batch
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)  # the same after a reconnect
        self._socket.setsockopt(zmq.RECONNECT_IVL, 100)
        self._socket.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        password = _password_of(url)
        if password:
            self._socket.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER.encode())
            self._socket.setsockopt(zmq.PLAIN_PASSWORD, password.encode())
        self._monitor = self._socket.get_monitor_socket(AUTH_FAILURES)
        self._socket.connect(endpoint_of(url))
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._credits: dict[str, tuple[int, float]] = {}  # stream -> (count, valid until)
        self._own_cursor: dict[tuple[str, str, str], int] = {}
        self._own_done: set[tuple[str, str, str]] = set()
        self.retries = 0
        """Requests resent because the broker did not answer in time."""
        self._closed = False
        try:
            self._request("ping")
        except TransportError:
            self._close_sockets(linger=0)
            raise

    # ---- request/reply ---------------------------------------------------------------------------
    def _request(
        self, op: str, *args, frames: Sequence[bytes] = (), timeout: float | None = None, status_ok=("ok",)
    ):
        """Send one request (header + payload `frames`) and wait for its reply;
        returns (status, result, payload frames of the reply as bytes)."""
        timeout = self.request_timeout_s if timeout is None else timeout
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            rid = next(self._ids)
            fence = self.fence
            head = (
                [rid, op, *args]
                if fence is None or op not in FENCED_OPS
                else [rid, "fenced", fence.key, fence.epoch, op, *args]
            )
            message = [msgspec.msgpack.encode(head), *frames]
            give_up = time.monotonic() + self.options.reconnect_s
            attempt = 0
            while True:
                self._socket.send_multipart(message, copy=False)
                reply = self._await(rid, time.monotonic() + timeout)
                if reply is not None:
                    break
                attempt += 1
                self._check_refused()
                if time.monotonic() >= give_up:
                    raise TransportError(
                        f"zmq broker at {redact(self.url)} did not answer {op!r} within {timeout:.3g}s"
                        + (
                            f" ({attempt} attempts over {self.options.reconnect_s:.3g}s)"
                            if attempt > 1
                            else ""
                        )
                    )
                self.retries += 1
                time.sleep(min(0.05 * 2 ** (attempt - 1), 2.0, max(0.0, give_up - time.monotonic())))
        status, result, payloads = reply
        if status in status_ok:
            return status, result, payloads
        if isinstance(result, str) and result.startswith(FENCED):
            raise FencedError(f"zmq broker refused {op!r}: {result}")
        raise TransportError(f"zmq broker refused {op!r}: {result}")

    def _check_refused(self) -> None:
        """Raise TransportError if the broker refused this client's credentials (socket monitor)."""
        while self._monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)
            if event["event"] & AUTH_FAILURES:
                raise TransportError(
                    f"zmq broker at {redact(self.url)} refused this client's credentials: a wrong or "
                    "missing password (BrokerConfig.password_file or $PARALLAX_BROKER_PASSWORD)"
                )

    def _await(self, rid: int, deadline: float):
        """The reply to request `rid` as (status, result, payload bytes), or None at the deadline."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._socket.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                if time.monotonic() >= deadline:
                    return None
                continue
            header, *payloads = self._socket.recv_multipart(copy=False)
            reply_id, status, result, credits = msgspec.msgpack.decode(header.buffer)
            if credits is not None:  # late replies still tell us our credits
                stream, count, lease_s = credits
                self._credits[stream] = (count, time.monotonic() + 0.9 * lease_s)
            if reply_id == rid:
                return status, result, [p.bytes for p in payloads]

    # ---- streams --------------------------------------------------------------------------------
    def ensure_group(self, stream: str, group: str) -> None:
        """Create `group` on `stream` (from its oldest retained entry) unless it exists."""
        self._request("ensure_group", stream, group)

    def publish_many(
        self,
        stream: str,
        payloads: Sequence[bytes],
        *,
        timeout: float | None = 30.0,
        keys: Sequence[str] | None = None,
    ) -> list[str]:
        check_keys(payloads, keys)
        for payload in payloads:
            check_size(f"{stream}: entry", len(payload), self.options.max_entry_bytes)
        deadline = None if timeout is None else time.monotonic() + timeout
        ids: list[str] = []
        while len(ids) < len(payloads):
            have = self._credits_left(stream)
            if have == 0:
                self._wait_for_credit(stream, deadline, timeout, ids, len(payloads))
                continue
            end = len(ids) + min(have, PUBLISH_CHUNK)
            chunk = list(payloads[len(ids) : end])
            chunk_keys = None if keys is None else list(keys[len(ids) : end])
            status, result, _ = self._request(
                "publish", stream, chunk_keys, frames=chunk, status_ok=("ok", "nocredit")
            )
            if status == "ok":
                ids.extend(result)
        return ids

    def _credits_left(self, stream: str) -> int:
        count, valid_until = self._credits.get(stream, (0, 0.0))
        return count if valid_until > time.monotonic() else 0

    def _wait_for_credit(self, stream, deadline, timeout, ids, total) -> None:
        remaining = CREDIT_WAIT_S if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            exc = BackpressureTimeout(
                f"{stream}: no credit from the zmq broker for {timeout:.3g}s (backlog at "
                f"max_len={self.options.max_len}; {len(ids)}/{total} published); consumers are not keeping up"
            )
            exc.published = ids
            raise exc
        wait_s = min(remaining, CREDIT_WAIT_S)
        self._request(
            "credit",
            stream,
            max(self.credit_batch, total - len(ids)),
            self.options.max_len,
            wait_s,
            timeout=wait_s + self.request_timeout_s,
        )

    def consume(
        self, stream: str, group: str, consumer: str, *, count: int = 1, block_s: float = 1.0
    ) -> Deliveries:
        opts = self.options
        key = (stream, group, consumer)
        if key not in self._own_done:
            own = self._read_own(key, max(1, count))
            if own or own.capped:
                return own
        block_s = max(0.0, block_s)
        _, (entries, capped), payloads = self._request(
            "consume",
            stream,
            group,
            consumer,
            max(1, count),
            block_s,
            opts.claim_idle_s,
            opts.max_deliveries,
            timeout=block_s + self.request_timeout_s,
        )
        return Deliveries(
            (
                Delivery(stream, id_, payload, attempts)
                for (id_, attempts), payload in zip(entries, payloads, strict=True)
            ),
            capped=capped,
        )

    def _read_own(self, key: tuple[str, str, str], count: int) -> Deliveries:
        """The next page of this consumer's own pending entries (empty once all are re-read)."""
        stream, group, consumer = key
        after = self._own_cursor.get(key, 0)
        _, (entries, capped, read), payloads = self._request(
            "read_own", stream, group, consumer, after, count, self.options.max_deliveries
        )
        if entries:
            self._own_cursor[key] = max(after, max(int(id_) for id_, _ in entries))
        if read < count:
            self._own_done.add(key)
        return Deliveries(
            (
                Delivery(stream, id_, payload, attempts)
                for (id_, attempts), payload in zip(entries, payloads, strict=True)
            ),
            capped=capped,
        )

    def ack(self, stream: str, group: str, ids: Sequence[str]) -> None:
        if ids:
            self._request("ack", stream, group, list(ids))

    def dead_letter(self, delivery: Delivery, group: str, reason: str) -> None:
        payload = delivery.payload
        kept = bytes(payload[: self.options.dead_payload_bytes])
        args = (delivery.stream, group, delivery.id, delivery.attempts, reason, len(payload))
        self._request("dead", *args, frames=[kept])

    def dead_letters(self, stream: str, count: int = 100) -> list[DeadLetter]:
        """The oldest `count` dead-lettered entries of `stream` (for inspection)."""
        _, rows, payloads = self._request("dead_letters", stream, count)
        return [
            DeadLetter(id=i, payload=p, reason=r, group=g, attempts=a, nbytes=n)
            for (i, r, g, a, n), p in zip(rows, payloads, strict=True)
        ]

    def pending(self, stream: str, group: str) -> int:
        return self._request("pending", stream, group)[1]

    def backlog(self, stream: str) -> int:
        return self._request("backlog", stream)[1]

    # ---- blobs and values -------------------------------------------------------------------------
    def put_blob(self, key: str, data: bytes, *, ttl_s: float | None = None) -> None:
        check_size(f"blob {key}", len(data), self.options.max_blob_bytes)
        ttl = ttl_s if ttl_s is not None else self.options.blob_ttl_s
        self._request("put_blob", key, ttl, frames=[data])

    def get_blob(self, key: str) -> bytes | None:
        _, found, payloads = self._request("get_blob", key)
        return payloads[0] if found else None

    def get_blobs(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        _, found, payloads = self._request("get_blobs", list(keys))
        present = iter(payloads)
        return [next(present) if hit else None for hit in found]

    def set_value(self, key: str, value: bytes) -> None:
        self._request("set_value", key, value)

    def set_value_nx(self, key: str, value: bytes, *, ttl_s: float | None = None) -> bool:
        return bool(self._request("set_value_nx", key, value)[1])

    def get_value(self, key: str) -> bytes | None:
        return self._request("get_value", key)[1]

    def release(self, stream: str, group: str, consumer: str) -> int:
        return self._request("release", stream, group, consumer)[1]

    # ---- leases -----------------------------------------------------------------------------------
    def acquire_lease(
        self, key: str, holder: bytes, ttl_s: float, *, replace: bytes | None = None
    ) -> LeaseState:
        taken, epoch, current = self._request("lease_acquire", key, holder, ttl_s, replace)[1]
        return LeaseState(bool(taken), int(epoch), bytes(current))

    def renew_lease(self, key: str, epoch: int, holder: bytes, ttl_s: float) -> bool:
        return bool(self._request("lease_renew", key, epoch, holder, ttl_s)[1])

    def release_lease(self, key: str, epoch: int) -> None:
        self._request("lease_release", key, epoch)

    def check_fence(self) -> None:
        if self.fence is not None:
            self._request("check_fence")

    def close(self) -> None:
        """Hand unused credits back and close the socket (after any request in flight)."""
        with self._lock:
            if self._closed:
                return
            for stream in [s for s in self._credits if self._credits_left(s)]:
                try:  # best effort: the lease would expire anyway
                    self._socket.send(msgspec.msgpack.encode([0, "release_credits", stream]), zmq.NOBLOCK)
                except zmq.ZMQError:
                    break
            self._closed = True
            self._close_sockets(linger=100)

    def _close_sockets(self, linger: int) -> None:
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=linger)


def _password_of(url: str) -> str | None:
    """The password in zmq://[user]:password@host:port (None without one)."""
    from urllib.parse import unquote

    userinfo, at, _ = url.removeprefix("zmq://").rpartition("@")
    password = userinfo.partition(":")[2] if at else ""
    return unquote(password) or None
