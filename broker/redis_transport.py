"""Redis Streams implementation of `broker.transport.Transport` (redis-py).

* Streams with consumer groups (created from the stream's start with MKSTREAM; only BUSYGROUP
  is ignored). `consume` first reclaims entries idle longer than `claim_idle_s` on other
  (dead) consumers with XAUTOCLAIM, then reads new ones with XREADGROUP; entries delivered more
  than `max_deliveries` times go to `<stream>:dead` with the reason and are acked (and counted in
  the returned `Deliveries.capped`).
* Ack after processing (XACK); acked prefixes are trimmed exactly (XTRIM MINID below the first
  entry any group still needs), so the stream length is the backlog and unconsumed work is
  never trimmed. `publish` needs credits, granted (atomically, by a script) only while backlog +
  credits already granted < `max_len`; without any it polls with short sleeps, and raises
  `BackpressureTimeout` when that outlasts `timeout`. Credits are spent in MULTI/EXEC batches.
* Blobs (SET EX NX, expiry refreshed on every put) and latest values (SET/GET).
Password and user come from the URL: redis://[user]:password@host:port/db.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import redis

from broker import redis_scripts
from broker.names import Names
from broker.stream_options import Backoff, DeadLetter, StreamOptions
from broker.transport import BackpressureTimeout, Deliveries, Delivery, Transport, TransportError

PUBLISH_CHUNK = 256
"""Most XADDs per MULTI/EXEC in `publish_many`."""
MAX_BLOCK_S = 50.0
"""Longest single blocking read (below the socket timeout)."""


def redact(url: str) -> str:
    """`url` with any password replaced by ***."""
    scheme, sep, rest = url.partition("://")
    userinfo, at, hostpart = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{hostpart}"


class RedisTransport(Transport):
    """Streams, blobs and values on one Redis server; see the module docstring.

    `options` (or keyword `StreamOptions` fields) set the contract knobs; `credit_batch` is how
    many publish credits a producer asks for at a time, `credit_lease_s` how long unspent
    credits stay reserved for it (a dead producer's credits return after that).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        options: StreamOptions | None = None,
        *,
        credit_batch: int = 64,
        credit_lease_s: float = 30.0,
        **opts,
    ):
        self.options = options or StreamOptions(**opts)
        self.url = url
        self.credit_batch = credit_batch
        self.credit_lease_s = credit_lease_s
        self._token = uuid.uuid4().hex  # this producer's name in the credit hashes
        self._credits: dict[str, tuple[int, float]] = {}  # stream -> (count, spend before)
        self._publish_lock = threading.Lock()
        self._redis = redis.Redis.from_url(url, socket_timeout=MAX_BLOCK_S + 10, socket_connect_timeout=5)
        self._reserve_script = self._redis.register_script(redis_scripts.RESERVE)
        self._ack = self._redis.register_script(redis_scripts.ACK)
        self._reclaim = self._redis.register_script(redis_scripts.RECLAIM)
        self._dead = self._redis.register_script(redis_scripts.DEAD_LETTER)
        self._groups: set[tuple[str, str]] = set()
        self._last_reclaim: dict[tuple[str, str], float] = {}  # when a reclaim scan last completed
        self._reclaim_cursor: dict[tuple[str, str], str] = {}
        with self._errors("connect"):
            self._redis.ping()

    @contextlib.contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except redis.exceptions.RedisError as exc:
            raise TransportError(f"redis {what} failed ({redact(self.url)}): {exc}") from exc

    # ---- streams -------------------------------------------------------------------------------
    def ensure_group(self, stream: str, group: str) -> None:
        """Create `group` on `stream` (from its first entry) unless it exists."""
        if (stream, group) in self._groups:
            return
        try:
            self._redis.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise TransportError(f"cannot create group {group!r} on {stream!r}: {exc}") from exc
        except redis.exceptions.RedisError as exc:
            raise TransportError(f"cannot create group {group!r} on {stream!r}: {exc}") from exc
        self._groups.add((stream, group))

    def publish(self, stream: str, payload: bytes, *, timeout: float | None = 30.0) -> str:
        return self.publish_many(stream, [payload], timeout=timeout)[0]

    def publish_many(
        self, stream: str, payloads: Sequence[bytes], *, timeout: float | None = 30.0
    ) -> list[str]:
        """Publish in order, blocking while the stream is full; all ids, or BackpressureTimeout
        (whose `published` attribute lists the ids that did go out)."""
        with self._publish_lock:  # threads sharing this transport share its credits
            return self._publish_locked(stream, payloads, timeout)

    def _publish_locked(self, stream: str, payloads: Sequence[bytes], timeout: float | None) -> list[str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        ids: list[str] = []
        backoff = Backoff()
        while len(ids) < len(payloads):
            have = self._credits_left(stream)
            if have == 0 and self._reserve(stream, len(payloads) - len(ids)) == 0:
                if deadline is not None and time.monotonic() >= deadline:
                    exc = BackpressureTimeout(
                        f"{stream}: backlog stayed at max_len={self.options.max_len} for {timeout:.3g}s "
                        f"({len(ids)}/{len(payloads)} published); consumers are not keeping up"
                    )
                    exc.published = ids
                    raise exc
                delay = backoff.step()
                time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
                continue
            backoff.reset()
            chunk = payloads[len(ids) : len(ids) + min(self._credits_left(stream), PUBLISH_CHUNK)]
            ids.extend(self._spend(stream, chunk))
        return ids

    def _credits_left(self, stream: str) -> int:
        count, valid_until = self._credits.get(stream, (0, 0.0))
        return count if valid_until > time.monotonic() else 0

    def _reserve(self, stream: str, want: int) -> int:
        """Ask for credits (at least `credit_batch`); returns how many this producer holds now."""
        with self._errors("publish"):
            held = int(
                self._reserve_script(
                    keys=[stream, f"{stream}:credits", f"{stream}:leases"],
                    args=[
                        self._token,
                        max(want, self.credit_batch),
                        self.options.max_len,
                        int(self.credit_lease_s * 1000),
                    ],
                )
            )
        # Spend only well inside the lease: credits past it may have been handed to someone else.
        self._credits[stream] = (held, time.monotonic() + self.credit_lease_s / 2)
        return held

    def _spend(self, stream: str, payloads: Sequence[bytes]) -> list[str]:
        """XADD `payloads` and give back as many credits, in one MULTI/EXEC."""
        pipe = self._redis.pipeline(transaction=True)
        for payload in payloads:
            pipe.xadd(stream, {"d": payload})
        pipe.hincrby(f"{stream}:credits", self._token, -len(payloads))
        with self._errors("publish"):
            *added, held = pipe.execute()
        self._credits[stream] = (int(held), self._credits[stream][1])
        return [i.decode() for i in added]

    def consume(
        self, stream: str, group: str, consumer: str, *, count: int = 1, block_s: float = 1.0
    ) -> Deliveries:
        count = max(1, count)
        self.ensure_group(stream, group)
        out = self._reclaim_idle(stream, group, consumer, count)
        if len(out) >= count:
            return out
        block_ms = None if out or block_s <= 0 else max(1, int(min(block_s, MAX_BLOCK_S) * 1000))
        try:
            reply = self._redis.xreadgroup(
                group, consumer, {stream: ">"}, count=count - len(out), block=block_ms
            )
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise TransportError(f"redis consume failed: {exc}") from exc
            self._groups.discard((stream, group))  # stream deleted under us: recreate next time
            return out
        except redis.exceptions.RedisError as exc:
            raise TransportError(f"redis consume failed ({redact(self.url)}): {exc}") from exc
        for _name, entries in reply or []:
            for entry_id, fields in entries:
                out.append(Delivery(stream, entry_id.decode(), fields.get(b"d", b""), 1))
        return out

    def _reclaim_idle(self, stream: str, group: str, consumer: str, count: int) -> Deliveries:
        """XAUTOCLAIM idle entries, resuming the scan of the pending list where the last one ended."""
        key, now = (stream, group), time.monotonic()
        cursor = self._reclaim_cursor.get(key, "0-0")
        if cursor == "0-0" and now - self._last_reclaim.get(key, -1e9) < min(
            self.options.claim_idle_s / 4, 1.0
        ):
            return Deliveries()  # a full scan happened moments ago: nothing can have become idle since
        opts = self.options
        with self._errors("reclaim"):
            cursor, claimed, capped = self._reclaim(
                keys=[stream, Names.dead(stream)],
                args=[
                    group,
                    consumer,
                    int(opts.claim_idle_s * 1000),
                    count,
                    opts.max_deliveries,
                    opts.dead_max_len,
                    cursor,
                ],
            )
        self._reclaim_cursor[key] = cursor = cursor.decode()
        if cursor == "0-0":
            self._last_reclaim[key] = now
        return Deliveries(
            (Delivery(stream, i.decode(), payload, int(n)) for i, payload, n in claimed), capped=int(capped)
        )

    def ack(self, stream: str, group: str, ids: Sequence[str]) -> None:
        if not ids:
            return
        with self._errors("ack"):
            self._ack(keys=[stream], args=[group, *ids])

    def dead_letter(self, delivery: Delivery, group: str, reason: str) -> None:
        with self._errors("dead_letter"):
            self._dead(
                keys=[delivery.stream, Names.dead(delivery.stream)],
                args=[
                    group,
                    delivery.id,
                    delivery.payload,
                    delivery.attempts,
                    reason,
                    self.options.dead_max_len,
                ],
            )

    def dead_letters(self, stream: str, count: int = 100) -> list[DeadLetter]:
        """The oldest `count` entries of `<stream>:dead` (for inspection; not consumed)."""
        with self._errors("dead_letters"):
            entries = self._redis.xrange(Names.dead(stream), count=count)
        return [
            DeadLetter(
                id=f[b"id"].decode(),
                payload=f[b"d"],
                reason=f[b"reason"].decode(),
                group=f[b"group"].decode(),
                attempts=int(f[b"attempts"]),
            )
            for _id, f in entries
        ]

    def pending(self, stream: str, group: str) -> int:
        try:
            return int(self._redis.xpending(stream, group)["pending"])
        except redis.exceptions.ResponseError as exc:
            if "NOGROUP" in str(exc) or "no such key" in str(exc):
                return 0
            raise TransportError(f"redis pending failed: {exc}") from exc
        except redis.exceptions.RedisError as exc:
            raise TransportError(f"redis pending failed ({redact(self.url)}): {exc}") from exc

    def backlog(self, stream: str) -> int:
        with self._errors("backlog"):
            return int(self._redis.xlen(stream))

    # ---- blobs and values ----------------------------------------------------------------------
    def put_blob(self, key: str, data: bytes, *, ttl_s: float | None = None) -> None:
        ttl = ttl_s if ttl_s is not None else self.options.blob_ttl_s
        with self._errors("put_blob"):
            if ttl is None:
                self._redis.set(key, data, nx=True)
                self._redis.persist(key)
            elif not self._redis.pexpire(key, max(1, int(ttl * 1000))):  # refreshed if present
                self._redis.set(key, data, px=max(1, int(ttl * 1000)), nx=True)

    def get_blob(self, key: str) -> bytes | None:
        with self._errors("get_blob"):
            return self._redis.get(key)

    def get_blobs(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        with self._errors("get_blobs"):
            return self._redis.mget(list(keys))

    def set_value(self, key: str, value: bytes) -> None:
        with self._errors("set_value"):
            self._redis.set(key, value)

    def set_value_nx(self, key: str, value: bytes, *, ttl_s: float | None = None) -> bool:
        with self._errors("set_value_nx"):
            px = max(1, int(ttl_s * 1000)) if ttl_s is not None else None
            return bool(self._redis.set(key, value, nx=True, px=px))

    def get_value(self, key: str) -> bytes | None:
        with self._errors("get_value"):
            return self._redis.get(key)

    def close(self) -> None:
        for stream in [s for s in self._credits if self._credits_left(s)]:
            with contextlib.suppress(redis.exceptions.RedisError):  # hand unused credits back
                self._redis.hdel(f"{stream}:credits", self._token)
                self._redis.zrem(f"{stream}:leases", self._token)
        self._credits.clear()
        self._redis.close()
        self._redis.connection_pool.disconnect()
