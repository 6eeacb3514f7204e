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
  `BackpressureTimeout` when that outlasts `timeout`. Credits are spent in MULTI/EXEC batches;
  a keyed publish (`keys=`, idempotent) spends them in one script that appends only the entries
  whose key is new (`redis_scripts.PUBLISH_KEYED`).
* Blobs (SET EX NX, expiry refreshed on every put) and latest values (SET/GET).
* With `fence` set, every publish, consume, ack, dead letter and `set_value` runs as a script behind the
  lease's epoch check (broker/redis_fence.py; a consume polls: a script cannot block).
* Restarts: the first `consume` of a (stream, group, consumer) in a process re-reads that
  consumer's own pending entries (XREADGROUP from id 0, page by page) before anything new, so a
  restarted process with the same consumer name gets back at once what it held when it died
  (instead of after `claim_idle_s`); the redelivery cap applies to them as well.
* A broker at its `maxmemory` refuses a write whole; the call backs off and retries as below meanwhile.
* Connection errors (server restarting or still loading its AOF, network blip): every call
  reconnects and retries with redis-py's `ExponentialBackoff` for up to `reconnect_s`, then
  raises `TransportError`. Each attempt waits at most the time left in that window (a server that
  stopped answering costs the window, not a 60 s socket timeout per try: broker/redis_deadline.py).
  A retried publish whose MULTI/EXEC reached the server but whose reply was lost appears twice
  (once with keys); every stage downstream is idempotent by group id.
Password and user come from the URL: redis://[user]:password@host:port/db.
* Byte caps: an entry above `max_entry_bytes` or a blob above `max_blob_bytes` raises
  `OversizeError` before anything is sent; a dead letter keeps a `dead_payload_bytes` prefix.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence

import redis
from redis.backoff import ExponentialBackoff

from broker import redis_fence, redis_scripts
from broker.names import Names
from broker.redis_deadline import NO_RETRY, attempt_until, connection_class
from broker.redis_fence import RedisLeases
from broker.stream_options import Backoff, DeadLetter, StreamOptions, check_size
from broker.transport import (
    FENCED,
    PUBLISH_KEY_TTL_S,
    BackpressureTimeout,
    Deliveries,
    Delivery,
    FencedError,
    Transport,
    TransportError,
    check_keys,
)
from runtime.redact import redact

log = logging.getLogger(__name__)
PUBLISH_CHUNK = 256
"""Most XADDs per MULTI/EXEC in `publish_many`."""
MAX_BLOCK_S = 50.0
"""Longest single blocking read (below the socket timeout)."""
RECONNECT_BACKOFF = ExponentialBackoff(cap=2.0, base=0.05)
"""Sleep before the n-th retry after a connection error: 0.05 s doubling up to 2 s."""
RETRIED = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.OutOfMemoryError)
"""Errors a call retries for `reconnect_s`: the server unreachable, or at its maxmemory (it refuses a write
whole; the consumers drain it meanwhile)."""
RELEASED_IDLE_MS = 365 * 24 * 3600 * 1000
"""The idle time a handed-back entry gets: above any claim_idle_s, so the next reclaim takes it."""
SCRIPTS = {
    name: getattr(redis_scripts, name)
    for name in ("ACK", "RECLAIM", "DEAD_LETTER", "READ_OWN", "PUBLISH_KEYED")
} | {name: getattr(redis_fence, name) for name in ("SPEND", "SET", "READ_NEW", "CHECK")}
"""The scripts that have a fenced variant (`redis_fence.fenced`), by name."""


class RedisTransport(RedisLeases, Transport):
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
        self.options.validate()
        self.url = url
        self.credit_batch = credit_batch
        self.credit_lease_s = credit_lease_s
        self._token = uuid.uuid4().hex  # this producer's name in the credit hashes
        self._credits: dict[str, tuple[int, float]] = {}  # stream -> (count, spend before)
        self._publish_lock = threading.Lock()
        self._redis = redis.Redis.from_url(
            url,
            socket_timeout=MAX_BLOCK_S + 10,
            socket_connect_timeout=5,
            retry=NO_RETRY,  # _call retries, each attempt bounded by the window
            connection_class=connection_class(url),
        )
        register = self._redis.register_script
        self._reserve_script = register(redis_scripts.RESERVE)
        self._release = register(redis_scripts.RELEASE)
        self._scripts = {
            name: (register(src), register(redis_fence.fenced(src))) for name, src in SCRIPTS.items()
        }
        self._lease_scripts = self.register_lease_scripts(register)
        self._groups: set[tuple[str, str]] = set()
        self._last_reclaim: dict[tuple[str, str], float] = {}  # when a reclaim scan last completed
        self._reclaim_cursor: dict[tuple[str, str], str] = {}
        self._own_cursor: dict[tuple[str, str, str], str] = {}  # own pending re-read so far; absent = not yet
        self._own_done: set[tuple[str, str, str]] = set()
        self.reconnects = 0
        """Connection errors this transport recovered from (retried successfully)."""
        self._call("connect", self._redis.ping)

    def _call(self, what: str, fn, *args, wait_s: float = 0.0, **kwargs):
        """`fn(*args, **kwargs)`, retried with back-off after connection errors for `reconnect_s`, each
        attempt bounded by the time left (plus `wait_s`, a blocking read's own wait); any other Redis
        error (or running out of time) is a TransportError."""
        deadline = time.monotonic() + self.options.reconnect_s
        failures = 0
        while True:
            try:
                bound = (
                    attempt_until(deadline + wait_s)
                    if self.options.reconnect_s > 0
                    else contextlib.nullcontext()
                )
                with bound:
                    result = fn(*args, **kwargs)
            except redis.exceptions.AuthenticationError as exc:  # a ConnectionError, but retrying won't help
                raise TransportError(f"redis {what} failed ({redact(self.url)}): {exc}") from exc
            except RETRIED as exc:
                failures += 1
                if failures == 1 and isinstance(exc, redis.exceptions.OutOfMemoryError):
                    log.warning("redis %s: the broker is at its maxmemory, backing off: %s", what, exc)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(
                        f"redis {what} failed ({redact(self.url)}) after {failures} attempts "
                        f"over {self.options.reconnect_s:.3g}s: {exc}"
                    ) from exc
                self._credits.clear()  # a lost MULTI/EXEC may or may not have spent them: ask again
                time.sleep(min(RECONNECT_BACKOFF.compute(failures), left))
                continue
            except redis.exceptions.RedisError as exc:
                if str(exc).startswith(FENCED):
                    raise FencedError(f"redis {what} refused: {exc}") from exc
                raise TransportError(f"redis {what} failed ({redact(self.url)}): {exc}") from exc
            if failures:
                self.reconnects += 1
            return result

    def _eval(self, what: str, name: str, keys: list, args: list, **kwargs):
        """Script `name` (`SCRIPTS`) through `_call`; behind the epoch check when `fence` is set."""
        plain, fenced = self._scripts[name]
        fence = self.fence
        if fence is None:
            return self._call(what, plain, keys=keys, args=args, **kwargs)
        return self._call(
            what, fenced, keys=[fence.key, fence.counter, *keys], args=[fence.epoch, *args], **kwargs
        )

    # ---- streams -------------------------------------------------------------------------------
    def ensure_group(self, stream: str, group: str) -> None:
        """Create `group` on `stream` (from its first entry) unless it exists."""
        if (stream, group) in self._groups:
            return
        try:
            self._call("create group", self._redis.xgroup_create, stream, group, id="0", mkstream=True)
        except TransportError as exc:
            if "BUSYGROUP" not in str(exc):
                raise TransportError(f"cannot create group {group!r} on {stream!r}: {exc}") from exc
        self._groups.add((stream, group))

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
        with self._publish_lock:  # threads sharing this transport share its credits
            return self._publish_locked(stream, payloads, timeout, keys)

    def _publish_locked(
        self, stream: str, payloads: Sequence[bytes], timeout: float | None, keys: Sequence[str] | None
    ) -> list[str]:
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
            end = len(ids) + min(self._credits_left(stream), PUBLISH_CHUNK)
            chunk = payloads[len(ids) : end]
            if keys is None:
                ids.extend(self._spend(stream, chunk))
            else:
                ids.extend(self._spend_keyed(stream, chunk, keys[len(ids) : end]))
        return ids

    def _credits_left(self, stream: str) -> int:
        count, valid_until = self._credits.get(stream, (0, 0.0))
        return count if valid_until > time.monotonic() else 0

    def _reserve(self, stream: str, want: int) -> int:
        """Ask for credits (at least `credit_batch`); returns how many this producer holds now."""
        held = int(
            self._call(
                "publish",
                self._reserve_script,
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

        def spend():
            pipe = self._redis.pipeline(transaction=True)
            for payload in payloads:
                pipe.xadd(stream, {"d": payload})
            pipe.hincrby(f"{stream}:credits", self._token, -len(payloads))
            return pipe.execute()

        valid_until = self._credits[stream][1]
        if self.fence is not None:  # the payloads pass through the script: only small fenced publishes
            held, added = self._eval(
                "publish", "SPEND", [stream, f"{stream}:credits"], [self._token, *payloads]
            )
        else:
            *added, held = self._call("publish", spend)
        self._credits[stream] = (int(held), valid_until)
        return [i.decode() for i in added]

    def _spend_keyed(self, stream: str, payloads: Sequence[bytes], keys: Sequence[str]) -> list[str]:
        """XADD the entries whose key is new, SET their keys, give back as many credits: one script."""
        valid_until = self._credits[stream][1]
        held, added = self._eval(
            "publish",
            "PUBLISH_KEYED",
            keys=[stream, f"{stream}:credits", *keys],
            args=[self._token, int(PUBLISH_KEY_TTL_S * 1000), *payloads],
        )
        self._credits[stream] = (int(held), valid_until)
        return [i.decode() for i in added]

    def consume(
        self, stream: str, group: str, consumer: str, *, count: int = 1, block_s: float = 1.0
    ) -> Deliveries:
        count = max(1, count)
        self.ensure_group(stream, group)
        if (stream, group, consumer) not in self._own_done:
            own = self._reread_own(stream, group, consumer, count)
            if own or own.capped:
                return own
        out = self._reclaim_idle(stream, group, consumer, count)
        if len(out) >= count:
            return out
        block_ms = None if out or block_s <= 0 else max(1, int(min(block_s, MAX_BLOCK_S) * 1000))
        try:
            if self.fence is not None:
                reply = self._read_new_fenced(
                    stream, group, consumer, count - len(out), (block_ms or 0) / 1000
                )
            else:
                reply = self._call(
                    "consume",
                    self._redis.xreadgroup,
                    group,
                    consumer,
                    {stream: ">"},
                    count=count - len(out),
                    block=block_ms,
                    wait_s=(block_ms or 0) / 1000,
                )
        except TransportError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._groups.discard((stream, group))  # stream deleted under us: recreate next time
            return out
        for _name, entries in reply or []:
            for entry_id, fields in entries:
                out.append(Delivery(stream, entry_id.decode(), fields.get(b"d", b""), 1))
        return out

    def _read_new_fenced(self, stream: str, group: str, consumer: str, count: int, block_s: float):
        """XREADGROUP of new entries behind the epoch check, polled (with back-off) for up to `block_s`."""
        deadline, backoff = time.monotonic() + block_s, Backoff(0.005, 0.1)
        while True:
            reply = self._eval("consume", "READ_NEW", [stream], [group, consumer, count])
            left = deadline - time.monotonic()
            if reply or left <= 0:  # as redis-py's xreadgroup answers: fields in a dict
                return [
                    (name, [(i, dict(zip(f[::2], f[1::2]))) for i, f in entries])
                    for name, entries in reply or []
                ]
            time.sleep(min(backoff.step(), left))

    def _reread_own(self, stream: str, group: str, consumer: str, count: int) -> Deliveries:
        """The next page of this consumer's own pending entries (empty once they are all re-read)."""
        key, opts = (stream, group, consumer), self.options
        after = self._own_cursor.get(key, "0")
        last, entries, capped, read = self._eval(
            "consume",
            "READ_OWN",
            keys=[stream, Names.dead(stream)],
            args=[
                group,
                consumer,
                after,
                count,
                opts.max_deliveries,
                opts.dead_max_len,
                opts.dead_payload_bytes,
            ],
        )
        self._own_cursor[key] = last.decode() if isinstance(last, bytes) else str(last)
        if int(read) < count:
            self._own_done.add(key)
        return Deliveries(
            (Delivery(stream, i.decode(), payload, int(n)) for i, payload, n in entries), capped=int(capped)
        )

    def _reclaim_idle(self, stream: str, group: str, consumer: str, count: int) -> Deliveries:
        """XAUTOCLAIM idle entries, resuming the scan of the pending list where the last one ended."""
        key, now = (stream, group), time.monotonic()
        cursor = self._reclaim_cursor.get(key, "0-0")
        if cursor == "0-0" and now - self._last_reclaim.get(key, -1e9) < min(
            self.options.claim_idle_s / 4, 1.0
        ):
            return Deliveries()  # a full scan happened moments ago: nothing can have become idle since
        opts = self.options
        cursor, claimed, capped = self._eval(
            "reclaim",
            "RECLAIM",
            keys=[stream, Names.dead(stream)],
            args=[
                group,
                consumer,
                int(opts.claim_idle_s * 1000),
                count,
                opts.max_deliveries,
                opts.dead_max_len,
                cursor,
                opts.dead_payload_bytes,
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
        self._eval("ack", "ACK", keys=[stream], args=[group, *ids])

    def dead_letter(self, delivery: Delivery, group: str, reason: str) -> None:
        self._eval(
            "dead_letter",
            "DEAD_LETTER",
            keys=[delivery.stream, Names.dead(delivery.stream)],
            args=[
                group,
                delivery.id,
                bytes(delivery.payload[: self.options.dead_payload_bytes]),
                delivery.attempts,
                reason,
                self.options.dead_max_len,
                len(delivery.payload),
            ],
        )

    def release(self, stream: str, group: str, consumer: str) -> int:
        args = [group, consumer, RELEASED_IDLE_MS]
        try:
            return int(self._call("release", self._release, keys=[stream], args=args))
        except TransportError as exc:
            if "NOGROUP" in str(exc) or "no such key" in str(exc):
                return 0
            raise

    def dead_letters(self, stream: str, count: int = 100) -> list[DeadLetter]:
        """The oldest `count` entries of `<stream>:dead` (for inspection; not consumed)."""
        entries = self._call("dead_letters", self._redis.xrange, Names.dead(stream), count=count)
        return [
            DeadLetter(
                id=f[b"id"].decode(),
                payload=f[b"d"],
                reason=f[b"reason"].decode(),
                group=f[b"group"].decode(),
                attempts=int(f[b"attempts"]),
                nbytes=int(f.get(b"n", -1)),
            )
            for _id, f in entries
        ]

    def pending(self, stream: str, group: str) -> int:
        try:
            return int(self._call("pending", self._redis.xpending, stream, group)["pending"])
        except TransportError as exc:
            if "NOGROUP" in str(exc) or "no such key" in str(exc):
                return 0
            raise

    def backlog(self, stream: str) -> int:
        return int(self._call("backlog", self._redis.xlen, stream))

    # ---- blobs and values ----------------------------------------------------------------------
    def put_blob(self, key: str, data: bytes, *, ttl_s: float | None = None) -> None:
        check_size(f"blob {key}", len(data), self.options.max_blob_bytes)
        ttl = ttl_s if ttl_s is not None else self.options.blob_ttl_s

        def put():
            if ttl is None:
                self._redis.set(key, data, nx=True)
                self._redis.persist(key)
            elif not self._redis.pexpire(key, max(1, int(ttl * 1000))):  # refreshed if present
                self._redis.set(key, data, px=max(1, int(ttl * 1000)), nx=True)

        self._call("put_blob", put)

    def get_blob(self, key: str) -> bytes | None:
        return self._call("get_blob", self._redis.get, key)

    def get_blobs(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return self._call("get_blobs", self._redis.mget, list(keys))

    def set_value(self, key: str, value: bytes) -> None:
        if self.fence is not None:
            self._eval("set_value", "SET", [key], [value])
        else:
            self._call("set_value", self._redis.set, key, value)

    def set_value_nx(self, key: str, value: bytes, *, ttl_s: float | None = None) -> bool:
        px = max(1, int(ttl_s * 1000)) if ttl_s is not None else None
        return bool(self._call("set_value_nx", self._redis.set, key, value, nx=True, px=px))

    def get_value(self, key: str) -> bytes | None:
        return self._call("get_value", self._redis.get, key)

    def close(self) -> None:
        for stream in [s for s in self._credits if self._credits_left(s)]:
            with contextlib.suppress(redis.exceptions.RedisError):  # hand unused credits back
                self._redis.hdel(f"{stream}:credits", self._token)
                self._redis.zrem(f"{stream}:leases", self._token)
        self._credits.clear()
        self._redis.close()
        self._redis.connection_pool.disconnect()
