"""The ZeroMQ broker process: a ROUTER socket serving `broker.zmq_state.BrokerState`.

Run it with `python -m broker zmq-broker --bind tcp://127.0.0.1:5555 --password-file FILE`, or in a
thread with `BrokerThread().start()` (tests). Clients (`broker.zmq_transport.ZmqTransport`) talk to it
over DEALER sockets; a message is a msgpack header frame plus raw payload frames (no pickle):

    request  [request_id, op, *args]                                     + payload frames
    reply    [request_id, status ("ok" | "err" | "nocredit"), result, credits] + payload frames

`credits` is [stream, count, lease_s] on replies that change a client's credits, else nil.
Payloads (entries, blobs) travel as their own frames: the broker keeps the frames it received
and sends them on to consumers without copying or re-encoding them.
Requests that cannot be answered yet are parked: a blocking `consume` until an entry arrives or
its `block_s` ends, a `credit` request until the backlog drops below `max_len` or its `wait_s`
ends. That parking is the back-pressure: a slow consumer holds producers at the broker instead
of letting the broker's memory grow.
Retries are exactly-once: a client resends a request that timed out with the same request id
(its socket identity is fixed, so it survives reconnects); the broker answers a repeat of the
request it answered last with that same reply again, and ignores a repeat of one still parked.

Fenced requests: [request_id, "fenced", lease key, epoch, op, *args] runs `op` only while the lease
holds that epoch (`BrokerState.fence_holds`), checked in the same turn of the loop as the op itself (a
parked consume is checked again when it is answered); else the reply is an error starting with FENCED.

Clients authenticate: with a password (`--password-file`, else $PARALLAX_BROKER_PASSWORD), every
connection's handshake must present it (ZeroMQ PLAIN, checked by pyzmq's ZAP authenticator on the
broker's own context), so a client without it is never served; without one the broker serves anyone
and says so at start. PLAIN sends the password in clear: across hosts, tunnel the port (docs/security.md).
A frame above `max_frame_bytes` (ZMQ_MAXMSGSIZE) disconnects its sender before the broker reads it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from broker.config import PASSWORD_ENV
from broker.redis_server import free_port, stop_process
from broker.stream_options import StreamOptions
from broker.zmq_state import BrokerState
from runtime.private import new_secret, read_secret

log = logging.getLogger(__name__)
TICK_S = 0.05
"""Longest wait between timer checks (parked deadlines, lease expiry, blob and key expiry)."""
PLAIN_USER = "parallax"
"""The user name of ZeroMQ PLAIN (only the password is secret)."""
MAX_FRAME_BYTES = max(StreamOptions.max_entry_bytes, StreamOptions.max_blob_bytes) + 1024 * 1024
"""Default largest frame a client may send: the largest entry or blob, plus room for a header."""


@dataclass
class ZmqBrokerConfig:
    """`python -m broker zmq-broker`: one ZeroMQ broker process."""

    bind: str = "tcp://127.0.0.1:5555"
    """ZeroMQ endpoint to bind (port 0 or * picks a free port, printed at start)."""
    password_file: str = ""
    """File whose first line is the password every client connection must present ("" =
    $PARALLAX_BROKER_PASSWORD; with neither, the broker serves any client)."""
    max_frame_bytes: int = MAX_FRAME_BYTES
    """A client that sends a larger frame is disconnected (ZMQ_MAXMSGSIZE)."""

    def password(self) -> str | None:
        if self.password_file:
            return read_secret(self.password_file)
        return os.environ.get(PASSWORD_ENV) or None


class ZmqBroker:
    """The socket loop; `bind()` then `serve(stop)` from one thread.

    Handlers take (client, rid, frames, *args) and return (status, result, credits[, frames])
    or None when the request is parked (answered later by `_reply`).
    """

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:5555",
        context: zmq.Context | None = None,
        *,
        password: str | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ):
        self.bind_address = bind[:-2] + ":*" if bind.endswith(":0") else bind
        self._own_context = context is None  # the authenticator owns its context's ZAP endpoint
        self.context = context or zmq.Context()
        self.password = password
        self.max_frame_bytes = max_frame_bytes
        self.authenticator: ThreadAuthenticator | None = None
        self.state = BrokerState()
        self.socket: zmq.Socket | None = None
        self._waiting_consume: dict[str, list] = {}
        self._waiting_credit: dict[str, deque] = {}
        self._last_reply: dict[bytes, tuple] = {}  # client -> (rid, header, frames) of its last reply
        self._parked: set[tuple[bytes, object]] = set()  # (client, rid) of requests not answered yet
        state = self.state
        self._ops = {
            "ping": lambda c, r, f: ("ok", "pong", None),
            "credit": self._credit,
            "publish": self._publish,
            "release_credits": self._release,
            "consume": self._consume,
            "read_own": self._read_own,
            "ack": self._ack,
            "dead": self._dead,
            "dead_letters": self._dead_letters,
            "pending": lambda c, r, f, stream, group: ("ok", state.pending(stream, group), None),
            "backlog": lambda c, r, f, stream: ("ok", state.backlog(stream), None),
            "ensure_group": self._ensure_group,
            "put_blob": lambda c, r, f, key, ttl: ("ok", state.put_blob(key, f[0], ttl), None),
            "get_blob": self._get_blob,
            "get_blobs": self._get_blobs,
            "set_value": lambda c, r, f, key, value: ("ok", state.values.__setitem__(key, value), None),
            "set_value_nx": lambda c, r, f, key, value: (
                "ok",
                state.values.setdefault(key, value) is value,
                None,
            ),
            "get_value": lambda c, r, f, key: ("ok", state.values.get(key), None),
            "release": self._release_pending,
            "lease_acquire": lambda c, r, f, *args: ("ok", state.acquire_lease(*args), None),
            "lease_renew": lambda c, r, f, *args: ("ok", state.renew_lease(*args), None),
            "lease_release": lambda c, r, f, *args: ("ok", state.release_lease(*args), None),
            "fenced": self._fenced,
            "check_fence": lambda c, r, f: ("ok", True, None),
        }

    def bind(self) -> str:
        """Bind the ROUTER socket; returns the endpoint actually bound (tcp://host:port)."""
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        if self.password:
            self.authenticator = ThreadAuthenticator(self.context)
            self.authenticator.start()
            self.authenticator.configure_plain(domain="*", passwords={PLAIN_USER: self.password})
            self.socket.setsockopt(zmq.PLAIN_SERVER, 1)
        else:
            log.warning(
                "zmq broker without a password: any client that reaches %s is served", self.bind_address
            )
        self.socket.bind(self.bind_address)
        return self.socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def serve(self, stop: threading.Event) -> None:
        """Answer requests until `stop` is set; closes the socket at the end."""
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        last_tick = 0.0
        try:
            while not stop.is_set():
                if poller.poll(int(TICK_S * 1000)):
                    self._drain()
                if time.monotonic() - last_tick >= TICK_S / 10:
                    self._on_tick()
                    last_tick = time.monotonic()
        finally:
            self.socket.close(linger=0)
            if self.authenticator is not None:
                self.authenticator.stop()
            if self._own_context:
                self.context.term()

    def _drain(self, limit: int = 1000) -> None:
        for _ in range(limit):
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) >= 2:
                self._handle(frames[0].bytes, frames[1], frames[2:])

    def _handle(self, client: bytes, header: zmq.Frame, frames: list[zmq.Frame]) -> None:
        rid = None
        try:
            request = msgspec.msgpack.decode(header.buffer)
            rid, op, args = request[0], request[1], request[2:]
            if self._repeated(client, rid):
                return
            reply = self._ops[op](client, rid, frames, *args)
        except KeyError as exc:
            reply = ("err", f"unknown op or stream/key: {exc}", None)
        except Exception as exc:  # a bad request never takes the broker down
            log.warning("bad request from %r: %s", client, exc)
            reply = ("err", f"{type(exc).__name__}: {exc}", None)
        if reply is not None:
            self._reply(client, rid, *reply)
        elif rid:
            self._parked.add((client, rid))

    def _repeated(self, client: bytes, rid) -> bool:
        """A client's retry of its last request: answer it again (or wait for the parked one)."""
        if not rid:
            return False
        if (client, rid) in self._parked:
            return True
        last = self._last_reply.get(client)
        if last is not None and last[0] == rid:
            self.socket.send_multipart([client, last[1], *last[2]], copy=False)
            return True
        return False

    def _reply(self, client: bytes, rid, status: str, result, credits, frames=()) -> None:
        """Header frame plus payload frames; stored frames are re-sent without copying."""
        header = msgspec.msgpack.encode([rid, status, result, credits])
        self._parked.discard((client, rid))
        if rid:
            self._last_reply[client] = (rid, header, list(frames))
        self.socket.send_multipart([client, header, *frames], copy=False)

    # ---- flow control --------------------------------------------------------------------------
    def _credit(self, client, rid, frames, stream, want, max_len, wait_s):
        count, lease = self.state.grant(client, stream, want, max_len)
        if count > 0 or wait_s <= 0:
            return "ok", count, [stream, count, lease]
        waiters = self._waiting_credit.setdefault(stream, deque())
        waiters.append((client, rid, want, max_len, time.monotonic() + wait_s))
        return None

    def _serve_credit_waiters(self, stream: str, now: float) -> None:
        waiters = self._waiting_credit.get(stream)
        while waiters:
            client, rid, want, max_len, deadline = waiters[0]
            count, lease = self.state.grant(client, stream, want, max_len)
            if count == 0 and deadline > now:
                break  # first come, first served: later producers wait behind this one
            waiters.popleft()
            self._reply(client, rid, "ok", count, [stream, count, lease])

    def _publish(self, client, rid, frames, stream, keys=None):
        ids = self.state.publish(client, stream, frames, keys)  # entries keep the received frames
        credits = [stream, *self.state.credits_of(client, stream)]
        if ids is None:
            return "nocredit", f"{stream}: publish of {len(frames)} entries needs credits", credits
        self._serve_consumers(stream, time.monotonic())
        return "ok", ids, credits

    def _release(self, client, rid, frames, stream):
        self.state.release_credits(client, stream)
        self._serve_credit_waiters(stream, time.monotonic())
        return "ok", None, [stream, 0, 0.0]

    def _fenced(self, client, rid, frames, key, epoch, op, *args):
        if not self.state.fence_holds(key, epoch):
            return "err", f"FENCED lease {key} moved on from epoch {epoch}", None
        if op == "consume":
            return self._consume(client, rid, frames, *args, fence=(key, epoch))
        return self._ops[op](client, rid, frames, *args)

    def _release_pending(self, client, rid, frames, stream, group, consumer):
        return "ok", self.state.release(stream, group, consumer), None

    # ---- consuming -------------------------------------------------------------------------------
    def _consume(
        self, client, rid, frames, stream, group, consumer, count, block_s, claim_idle_s, max_deliveries,
        fence=None,
    ):  # fmt: skip
        out, capped = self.state.consume(stream, group, consumer, count, claim_idle_s, max_deliveries)
        self._serve_credit_waiters(stream, time.monotonic())  # reclaim may have dead-lettered some
        if out or block_s <= 0:
            return _deliveries_reply(out, capped)
        args = (stream, group, consumer, count, block_s, claim_idle_s, max_deliveries, capped, fence)
        self._waiting_consume.setdefault(stream, []).append((client, rid, args, time.monotonic() + block_s))
        return None

    def _read_own(self, client, rid, frames, stream, group, consumer, after, count, max_deliveries):
        out, capped, read = self.state.read_own(stream, group, consumer, int(after), count, max_deliveries)
        self._serve_credit_waiters(stream, time.monotonic())  # the cap may have dead-lettered some
        status, (entries, capped), credits, payloads = _deliveries_reply(out, capped)
        return status, [entries, capped, read], credits, payloads

    def _serve_consumers(self, stream: str, now: float) -> None:
        waiters = self._waiting_consume.get(stream)
        if not waiters:
            return
        keep = []
        for client, rid, args, deadline in waiters:
            stream_, group, consumer, count, _block, idle_s, max_deliveries, capped, fence = args
            if deadline > now and not self.state.has_new(stream_, group):
                keep.append((client, rid, args, deadline))
                continue
            if fence is not None and not self.state.fence_holds(*fence):
                self._reply(
                    client, rid, "err", f"FENCED lease {fence[0]} moved on from epoch {fence[1]}", None
                )
                continue
            out, more = self.state.consume(stream_, group, consumer, count, idle_s, max_deliveries)
            self._reply(client, rid, *_deliveries_reply(out, capped + more))
        self._waiting_consume[stream] = keep

    def _ensure_group(self, client, rid, frames, stream, group):
        self.state.ensure_group(stream, group)
        return "ok", None, None

    def _ack(self, client, rid, frames, stream, group, ids):
        n = self.state.ack(stream, group, ids)
        self._serve_credit_waiters(stream, time.monotonic())
        return "ok", n, None

    def _dead(self, client, rid, frames, stream, group, id_, attempts, reason, nbytes=-1):
        n = self.state.dead_letter(stream, group, id_, frames[0], attempts, reason, nbytes)
        self._serve_credit_waiters(stream, time.monotonic())
        return "ok", n, None

    def _dead_letters(self, client, rid, frames, stream, count):
        rows = list(self.state.stream(stream).dead)[:count]
        return "ok", [[i, r, g, a, n] for i, _, r, g, a, n in rows], None, [row[1] for row in rows]

    def _get_blob(self, client, rid, frames, key):
        data = self.state.get_blob(key)
        return ("ok", False, None) if data is None else ("ok", True, None, [data])

    def _get_blobs(self, client, rid, frames, keys):
        blobs = [self.state.get_blob(key) for key in keys]
        return "ok", [b is not None for b in blobs], None, [b for b in blobs if b is not None]

    # ---- timers ----------------------------------------------------------------------------------
    def _on_tick(self) -> None:
        now = time.monotonic()
        for stream in list(self._waiting_consume):
            self._serve_consumers(stream, now)
        for stream in list(self._waiting_credit):
            self._serve_credit_waiters(stream, now)  # leases may have expired, deadlines passed
        self.state.expire()


def _deliveries_reply(out: list, capped: int) -> tuple:
    """Reply to a consume: [[[id, attempts], ...], capped] in the header (capped: entries moved to
    the dead-letter list past max_deliveries), one payload frame per entry."""
    entries = [[id_, attempts] for id_, _, attempts in out]
    return "ok", [entries, capped], None, [payload for _, payload, _ in out]


class BrokerThread:
    """A ZmqBroker serving from a daemon thread (tests, demo), with a password drawn for it unless given
    (`password=""`: none); `url` is its zmq:// address with the password in it."""

    def __init__(
        self,
        bind: str = "tcp://127.0.0.1:0",
        password: str | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
    ):
        self.password = new_secret(18) if password is None else password
        self.broker = ZmqBroker(bind, password=self.password or None, max_frame_bytes=max_frame_bytes)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self) -> BrokerThread:
        endpoint = self.broker.bind()
        auth = f":{self.password}@" if self.password else ""
        self.url = f"zmq://{auth}" + endpoint.removeprefix("tcp://")
        self._thread = threading.Thread(
            target=self.broker.serve, args=(self._stop,), daemon=True, name="zmq-broker"
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> BrokerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(config: ZmqBrokerConfig) -> None:
    """Entry point of `python -m broker zmq-broker`; stops on Ctrl-C / SIGTERM."""
    broker = ZmqBroker(config.bind, password=config.password(), max_frame_bytes=config.max_frame_bytes)
    endpoint = broker.bind()
    print(f"zmq broker listening on zmq://{endpoint.removeprefix('tcp://')}", flush=True)
    try:
        broker.serve(threading.Event())
    except KeyboardInterrupt:
        pass


class BrokerProcess:
    """`python -m broker zmq-broker` as a child process on a free port (benchmark, demo), with a password
    drawn for it and handed over in its environment; `url` carries it."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.password = new_secret(18)
        self.url = f"zmq://:{self.password}@127.0.0.1:{self.port}"
        self.process = None

    def start(self) -> BrokerProcess:
        cmd = [sys.executable, "-m", "broker", "zmq-broker", "--bind", f"tcp://127.0.0.1:{self.port}"]
        env = {**os.environ, PASSWORD_ENV: self.password}
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        line = self.process.stdout.readline()  # "zmq broker listening on ..." once bound
        if "listening" not in line:
            self.stop()
            raise RuntimeError(f"zmq broker did not start (exit {self.process.returncode}): {line!r}")
        return self

    def stop(self) -> None:
        stop_process(self.process)

    def __enter__(self) -> BrokerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
