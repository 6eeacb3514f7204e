"""`broadcast` receiver: join the learner's weights group and receive whole versions in the background.

A thread joins the learner's rendezvous (the configured address, or the learner's announcement on
the broker), then loops: wait for the next manifest (a blocking TCPStore wait that the learner's
write wakes, renewed every second so that `close` is prompt), receive its buckets and checksum
trailer, verify, and only then put the version in the mailbox that `poll()` empties. A transfer
that fails or times out delivers nothing (the engine keeps its last good weights); the thread then
rejoins, and the learner sends the current version to a (re)joining generator. A learner that is
down is retried every `retry_s`, quietly.

Received buckets come from a small pool: a version's buffers return to it once nobody references
the `ReceivedVersion` any more (on CPU, fresh memory costs page faults that outweigh the copy).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import weakref

import torch

from weights.interface import ReceivedVersion, WeightReceiver
from weights.manifest import validate_manifest, verify
from weights.protocol import JoinAccept, JoinRequest, Keys, Manifest, decode
from weights.rendezvous import (
    JoinRefused,
    abort,
    connect,
    device_uuid,
    join,
    local_host_towards,
    pair_group,
    wait_work,
)

log = logging.getLogger(__name__)

IDLE_WAIT_S = 1.0
"""How long one blocking wait for the next manifest lasts before it is renewed (and `close` noticed)."""


class _BufferPool:
    """Host buffers of versions nobody holds any more, reused by size (GPU buffers: torch's allocator)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: dict[int, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def put(self, buffers: list[torch.Tensor]) -> None:
        if self.device.type != "cpu":
            return
        with self._lock:
            for buf in buffers:
                free = self._free.setdefault(buf.numel(), [])
                if len(free) < 2:
                    free.append(buf)


class _SessionEnded(Exception):
    """The learner closed our session or went away; rejoin."""


class _NoLearner(Exception):
    """Nothing to join yet (no announcement, or nobody listening there); retry quietly."""


class BroadcastReceiver(WeightReceiver):
    """Background receiver of whole, verified versions over a 2-rank process group."""

    transport = "broadcast"

    def __init__(self, config, generator_id, *, device: str = "cpu", **kwargs):
        """`device`: where buckets land ("cpu" for gloo; the engine's GPU for nccl)."""
        super().__init__(config, generator_id, **kwargs)
        self._pool = _BufferPool(torch.device(device))
        self._mailbox: ReceivedVersion | None = None
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._report: tuple | None = None
        """(store clone, session) of the current session: where `mark_served` reports the served version."""

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"weight-receiver-{self.generator_id}", daemon=True
            )
            self._thread.start()

    def _poll(self) -> ReceivedVersion | None:
        with self._lock:
            received, self._mailbox = self._mailbox, None
        return received

    def _release(self, version: int) -> None:
        with self._lock:
            report = self._report
        if report is not None:
            try:
                report[0].set(Keys.served(report[1]), str(version))
            except Exception:
                pass  # the learner is gone; the receiver thread notices and rejoins

    def _close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=self.config.timeout_s + 5)
            self._thread = None

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while not self._stop.is_set():
            session = None
            try:
                session = self._join()
                self._serve(*session)
            except _NoLearner as e:
                log.debug("weight receiver %s: %s", self.generator_id, e)
            except _SessionEnded as e:
                log.info("weight receiver %s: session ended (%s); rejoining", self.generator_id, e)
            except JoinRefused as e:
                self.stats.refused += 1
                self.stats.last_error = f"refused: {e}"
                log.error("weight receiver %s: the learner refused to let it join: %s", self.generator_id, e)
            except Exception as e:
                self.stats.last_error = f"{type(e).__name__}: {e}"
                log.warning("weight receiver %s: %s; rejoining", self.generator_id, self.stats.last_error)
            finally:
                with self._lock:
                    self._report = None
                if session is not None:
                    abort(session[1])
            self._stop.wait(self.config.retry_s)

    def _join(self):
        """Connect to the rendezvous, present the token, wait for the learner's accept, build the group."""
        target = self.target()
        if target is None:
            raise _NoLearner("no learner announced yet")
        try:
            store = connect(target.address, self.config.connect_timeout_s, self.config.timeout_s)
        except Exception as e:
            raise _NoLearner(f"no learner at {target.address}: {type(e).__name__}") from e
        host = target.address.rpartition(":")[0]
        request = JoinRequest(
            generator_id=self.generator_id,
            token=target.token,
            transport=self.transport,
            version=self._served,
            host=local_host_towards(host),
            device_uuid=device_uuid(self._pool.device),
        )
        accept = join(store, request)
        group = pair_group(accept.backend, store, accept.session, 1, accept.timeout_s, request.host)
        self.stats.joins += 1
        with self._lock:
            self._report = (store.clone(), accept.session)
        log.info("weight receiver %s joined %s (join %d)", self.generator_id, target.address, accept.session)
        return store, group, accept

    def _serve(self, store, group, accept: JoinAccept) -> None:
        transfer = 0
        while not self._stop.is_set():
            manifest = self._next_manifest(store, accept.session, transfer)
            if manifest is None:
                return
            received = self._receive(group, accept, manifest)
            transfer += 1
            weakref.finalize(received, self._pool.put, received.buffers)
            with self._lock:
                self._mailbox = received

    def _next_manifest(self, store, session: int, transfer: int) -> Manifest | None:
        """Block until the learner writes the next manifest or ends the session (or `close`)."""
        key = Keys.manifest(session, transfer)
        while not self._stop.is_set() and not store.check([key]):
            try:
                store.wait([key], datetime.timedelta(seconds=IDLE_WAIT_S))
            except Exception:
                store.check([key])  # raises if the learner is gone; else the wait just expired
        if self._stop.is_set():
            return None
        data = store.get(key)
        store.delete_key(key)
        if data.startswith(Keys.ENDED):
            raise _SessionEnded(data[len(Keys.ENDED) :].decode(errors="replace"))
        manifest = decode(data, Manifest)
        validate_manifest(manifest)
        return manifest

    def _receive(self, group, accept: JoinAccept, manifest: Manifest) -> ReceivedVersion:
        """Receive every bucket and the trailer; raise (delivering nothing) unless all verify."""
        t0 = time.perf_counter()
        buffers = [self._pool.get(n) for n in manifest.bucket_nbytes]
        try:
            tail = torch.empty(len(buffers) + 1, dtype=torch.int64, device=self._pool.device)
            works = [group.broadcast(buf, 0) for buf in [*buffers, tail]]
            for work in works:
                wait_work(work, accept.backend, accept.timeout_s)
            verify(manifest, buffers, tail)
        except Exception:
            self.stats.failures += 1
            self._pool.put(buffers)
            raise
        return ReceivedVersion(manifest, buffers, seconds=time.perf_counter() - t0)
