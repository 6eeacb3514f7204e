"""A lease on the broker that makes one process the only writer of what it names, and fences the others.

    lease = Lease(transport, names.learner_lease, holder=b'{"host": ...}', ttl_s=10)
    state = lease.acquire()              # LeaseState: taken (with a new epoch), or who holds it and since
    lease.start()                        # renews every ttl_s / 3 from a thread
    writer.fence = lease.fence           # that transport's writes are checked against the epoch
    ...
    lease.release()

A lease is taken only when it is free: never taken, released, or expired (its holder stopped renewing it
for `ttl_s`), or when the caller names the exact holder it found and knows to be dead (`replace`). Each
taking hands out the next epoch. A transport with `fence` set has every publish, consume, ack, dead letter
and `set_value` checked on the broker, atomically with the write (a Lua script on Redis, the same check
in the ZeroMQ broker's loop): once another process took the lease, they raise `FencedError` and change
nothing, so a holder that was paused, partitioned or simply replaced can never write over its successor.
The renewal thread sets `lost` (and calls `on_lost`) as soon as a renewal finds the lease taken; a broker
that does not answer only delays renewals (a lease that expired meanwhile and that nobody took is taken
again with the same epoch).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from broker.transport import Fence, LeaseState, Transport, TransportError

log = logging.getLogger(__name__)


class Lease:
    """One lease `key` held (or wanted) by `holder` through `transport`; see the module docstring."""

    def __init__(
        self,
        transport: Transport,
        key: str,
        holder: bytes,
        *,
        ttl_s: float = 10.0,
        on_lost: Callable[[], None] | None = None,
    ):
        self.transport, self.key, self.holder, self.ttl_s = transport, key, holder, ttl_s
        self.on_lost = on_lost or (lambda: None)
        self.epoch = 0
        """The epoch this process holds (0: none)."""
        self.lost = threading.Event()
        """Set once a renewal found the lease taken by another holder."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def fence(self) -> Fence:
        """What a writer's transport checks its writes against (`Transport.fence`)."""
        if not self.epoch:
            raise RuntimeError(f"lease {self.key} is not held")
        return Fence(self.key, self.epoch)

    def acquire(self, replace: bytes | None = None) -> LeaseState:
        """Take the lease if it is free (or held by exactly `replace`); the state found either way."""
        state = self.transport.acquire_lease(self.key, self.holder, self.ttl_s, replace=replace)
        if state.acquired:
            self.epoch = state.epoch
        return state

    def start(self) -> Lease:
        """Renew every `ttl_s` / 3 from a daemon thread until `release` (or the lease is lost)."""
        self._thread = threading.Thread(target=self._renew_loop, daemon=True, name="lease")
        self._thread.start()
        return self

    def renew(self) -> bool:
        """One renewal; False (and `lost` set, `on_lost` called) when another holder took the lease."""
        if self.transport.renew_lease(self.key, self.epoch, self.holder, self.ttl_s):
            return True
        if not self.lost.is_set():
            self.lost.set()
            log.error("lease %s of epoch %d was taken by another holder", self.key, self.epoch)
            self.on_lost()
        return False

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                if not self.renew():
                    return
            except TransportError as exc:  # the lease may expire meanwhile; if nobody took it, renewed later
                log.warning("lease %s not renewed: %s", self.key, exc)

    def release(self) -> None:
        """Stop renewing and give the lease up (if still held); best effort, idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self.epoch and not self.lost.is_set():
            try:
                self.transport.release_lease(self.key, self.epoch)
            except TransportError as exc:
                log.warning("lease %s not released (it expires in %.0f s): %s", self.key, self.ttl_s, exc)
        self.epoch = 0
