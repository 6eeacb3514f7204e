"""`cuda-ipc` receiver: join the learner's rendezvous, then hand out the shared buffer's new versions.

A background thread joins (the configured address or the learner's announcement, with the run's
token) and rejoins whenever the learner went away or dropped this generator. `poll()` itself never
blocks on the network beyond a few store round trips: it looks at the version in the buffer, takes
this session's lock when it is newer than the one served, and returns a `ReceivedVersion` whose
tensors are views into the learner's buffer, mapped in this process on first use only (`ipc`
carries the reference, so an engine whose model lives in another process maps it there instead).
`mark_served` waits for this process's copies out of the buffer, then lets go of the lock.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec
import torch

from weights import ipc
from weights.interface import ReceivedVersion, WeightReceiver
from weights.protocol import JoinRequest, Keys
from weights.rendezvous import JoinRefused, connect, join

log = logging.getLogger(__name__)


class IpcReceiver(WeightReceiver):
    """Generator side of cuda-ipc (see the module docstring)."""

    transport = "cuda-ipc"

    def __init__(self, config, generator_id, *, device: str = "cuda", **kwargs):
        super().__init__(config, generator_id, **kwargs)
        self._lock = threading.Lock()
        self._session: tuple | None = None
        """(store, session id) once joined."""
        self._layout: ipc.IpcLayout | None = None
        self._holding = False
        self._mapped_here = False
        self._taken = -1
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"ipc-receiver-{self.generator_id}", daemon=True
            )
            self._thread.start()

    def _poll(self) -> ReceivedVersion | None:
        with self._lock:
            if self._holding:
                raise RuntimeError("poll() again before mark_served()")
            if self._session is None:
                return None
            store, session = self._session
            try:
                return self._take(store, session)
            except (RuntimeError, OSError) as e:  # torch's DistError (store gone) is a RuntimeError
                self._disconnect(e)
                return None

    def _take(self, store, session: int) -> ReceivedVersion | None:
        t0 = time.perf_counter()
        version = self._latest(store, session)
        if version is None or version <= max(self._served, self._taken):
            return None
        got = store.compare_set(Keys.lock(session), Keys.FREE, Keys.READER)
        if got == Keys.DROPPED:
            self._session = None  # the learner gave up on us: the thread joins again
            return None
        if got != Keys.READER:
            return None  # the learner is packing: try again next step
        self._holding = True
        version, layout_id = map(  # stable while we hold the lock
            int, store.multi_get([Keys.version(session), Keys.layout_id(session)])
        )
        self._taken = version
        if self._layout is None or self._layout.layout_id != layout_id:
            self._layout = msgspec.msgpack.decode(store.get(Keys.layout(session)), type=ipc.IpcLayout)
        layout = self._layout
        return ReceivedVersion(
            layout.manifest,
            lambda: [self._map(layout)],
            seconds=time.perf_counter() - t0,
            ipc=layout,
            version=version,
        )

    def _map(self, layout: ipc.IpcLayout) -> torch.Tensor:
        buffer = ipc.mapping(layout)
        self._mapped_here = True
        return buffer

    def _release(self, version: int) -> None:
        with self._lock:
            if self._session is None:
                self._holding = False
                return
            store, session = self._session
            try:
                if self._holding:
                    if self._mapped_here and torch.cuda.is_available() and torch.cuda.is_initialized():
                        torch.cuda.synchronize()  # our copies out of the buffer must be done
                    self._holding = False
                    if store.compare_set(Keys.lock(session), Keys.READER, Keys.FREE) == Keys.DROPPED:
                        self._session = None  # held too long: the learner dropped us; rejoin
                        return
                store.set(Keys.served(session), str(version))
            except (RuntimeError, OSError) as e:
                self._disconnect(e)

    def _close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self.config.timeout_s + 5)
            self._thread = None
        with self._lock:
            if self._holding and self._session is not None:
                try:
                    self._session[0].set(Keys.lock(self._session[1]), Keys.FREE)
                except Exception:
                    pass
            self._session = None
        ipc.LOCAL_MAPPINGS.release()

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                session = self._session
            if session is None:
                self._join()
            else:
                self._check(session)
            self._stop.wait(
                self.config.retry_s if self._session is not None else min(self.config.retry_s, 0.05)
            )

    def _join(self) -> None:
        target = self.target()
        if target is None:
            return
        try:
            store = connect(target.address, self.config.connect_timeout_s, self.config.timeout_s)
            request = JoinRequest(
                generator_id=self.generator_id,
                token=target.token,
                transport=self.transport,
                version=self._served,
            )
            accept = join(store, request)
        except JoinRefused as e:
            self.stats.refused += 1
            self.stats.last_error = f"refused: {e}"
            log.error("cuda-ipc receiver %s: the learner refused to let it join: %s", self.generator_id, e)
            self._stop.wait(self.config.retry_s)
            return
        except Exception as e:
            log.debug("cuda-ipc receiver %s: no learner at %s (%s)", self.generator_id, target.address, e)
            self._stop.wait(self.config.retry_s)
            return
        with self._lock:
            self._session = (store, accept.session)
            self._layout = None
            self._taken = -1
        self.stats.joins += 1
        log.info(
            "cuda-ipc receiver %s joined %s (join %d)", self.generator_id, target.address, accept.session
        )

    def _check(self, session: tuple) -> None:
        """Notice a learner that went away (the store does not answer) while nothing is held."""
        with self._lock:
            if self._session is not session or self._holding:
                return
            try:
                session[0].check([Keys.lock(session[1])])
            except (RuntimeError, OSError) as e:
                self._disconnect(e)

    def _disconnect(self, error: Exception) -> None:
        """Forget the learner's store (caller holds the lock); the thread rejoins an announced learner."""
        self.stats.failures += 1
        self.stats.last_error = f"{type(error).__name__}: {error}"
        if self._withdrawn():
            log.info("cuda-ipc receiver %s: the learner closed its weight sync", self.generator_id)
        else:
            log.warning(
                "cuda-ipc receiver %s: learner store unreachable (%s); rejoining",
                self.generator_id,
                type(error).__name__,
            )
        self._session = None
        self._holding = False
        self._layout = None

    def _withdrawn(self) -> bool:
        """The learner closed on purpose: its announcement is withdrawn (weights.follow.broker_resolver)."""
        if self.config.address:
            return False
        try:
            return self.target() is None
        except Exception:  # the broker is unreachable too: say what we know, the store is
            return False

    @staticmethod
    def _latest(store, session: int) -> int | None:
        key = Keys.version(session)
        return int(store.get(key)) if store.check([key]) else None
