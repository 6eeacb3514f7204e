"""Each redis-py attempt bounded by the time left in the transport's reconnect window.

`RedisTransport._call` retries a call after connection errors for `reconnect_s`. A server that stopped
answering without closing its sockets (SIGSTOP, a frozen host) makes an attempt wait for the socket
timeout, and redis-py on its own retries a timed-out command up to 10 times: one attempt could outlast the
window many times over. So the transport's client retries nothing itself (`NO_RETRY`), and its connections
(`bounded(cls)`, a subclass of the URL's connection class) take their connect and read timeouts from the
deadline the calling thread set with `attempt_until(t)`: an attempt never waits past the window's end
(plus the server-side block of a blocking read, which the caller adds). Outside `attempt_until` the
connection's own timeouts apply.
"""

from __future__ import annotations

import contextlib
import threading
import time

from redis.backoff import NoBackoff
from redis.connection import Connection, parse_url
from redis.retry import Retry

NO_RETRY = Retry(NoBackoff(), 0)
"""redis-py's own retries off: the transport's reconnect loop is the only one."""
MIN_TIMEOUT_S = 0.5
"""Shortest timeout an attempt gets (a window about to end still makes one real try)."""

_deadline = threading.local()


@contextlib.contextmanager
def attempt_until(until: float):
    """Within the block, this thread's redis reads and connects time out at `until` (time.monotonic())."""
    previous = getattr(_deadline, "until", None)
    _deadline.until = until
    try:
        yield
    finally:
        _deadline.until = previous


def _left() -> float | None:
    until = getattr(_deadline, "until", None)
    return None if until is None else max(until - time.monotonic(), MIN_TIMEOUT_S)


def bounded(cls: type[Connection]) -> type[Connection]:
    """`cls` with its connect and read timeouts capped by the current attempt's deadline."""

    class Bounded(cls):
        def connect(self):
            left = _left()
            if left is not None and not self._sock:
                self.socket_connect_timeout = min(self._connect_cap, left)
            return super().connect()

        def read_response(self, *args, timeout=None, **kwargs):
            left = _left()
            if timeout is None:
                if left is None:
                    return super().read_response(*args, **kwargs)
                timeout = left if self.socket_timeout is None else min(self.socket_timeout, left)
            return super().read_response(*args, timeout=timeout, **kwargs)

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._connect_cap = self.socket_connect_timeout

    Bounded.__name__ = Bounded.__qualname__ = f"Bounded{cls.__name__}"
    return Bounded


def connection_class(url: str) -> type[Connection]:
    """The bounded connection class for `url` (TCP, TLS or a unix socket, as redis-py picks it)."""
    return bounded(parse_url(url).get("connection_class", Connection))
