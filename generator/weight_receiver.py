"""Generator side of weight sync: join the learner's weights group and receive whole versions.

A background thread joins the learner's rendezvous (an explicit "host:port", or one read from
the broker by `broker_resolver`), then loops: wait for the next manifest (a blocking TCPStore
wait, woken by the learner; no polling), receive its buckets and checksum trailer, verify, and
only then deliver the version. A transfer that fails or times out delivers nothing (the engine
keeps its last good weights); the thread then rejoins, and the learner sends the current version
to a (re)joining generator. A learner that is down is retried every `retry_s`, quietly.

Two ways to consume versions (protocol: `policy/weight_transfer.py`):
  * `apply(named_tensors, version)` callback, run on the receiver thread right after a version
    is verified (the engine must tolerate being called from another thread; the tensors are
    views into reused buffers, valid only during the call: copy them, as load_weights does);
  * no callback: the newest verified version waits in a mailbox; the engine loop calls
    `take()` between generation steps and applies it itself (no threading inside the engine).

    receiver = WeightReceiver(ReceiverConfig(generator_id="gen-0", address="10.0.0.5:29600"))
    receiver.start()
    ...between steps:
    if (new := receiver.take()) is not None:
        engine.load(new.named_tensors(), new.version)
        receiver.mark_served(new.version)
    receiver.close()

`module_loader(model)` is the reference `apply` for a plain transformers model (tests, learner-side
checks): it validates every name and shape first and copies only if all match.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from policy.weight_transfer import (
    JoinAccept,
    JoinRequest,
    Keys,
    Manifest,
    ReceiverStats,
    WeightTransferError,
    checkpoint_names,
    decode,
    device_uuid,
    encode,
    local_host_towards,
    named_tensors,
    pair_group,
    unpack,
    validate_manifest,
    verify,
    wait_work,
)

log = logging.getLogger(__name__)

ApplyFn = Callable[[Iterable[tuple[str, torch.Tensor]], int], None]


@dataclass
class ReceiverConfig:
    """Weight-sync settings of one generator engine."""

    generator_id: str
    """Unique per engine; a rejoin under the same id replaces the old session on the learner."""
    address: str = ""
    """Learner rendezvous "host:port"; "" asks the `resolve` callback (e.g. the broker) each time it joins."""
    device: str = "cpu"
    """Where received buckets land ("cpu" for gloo; the engine's GPU for nccl)."""
    timeout_s: float = 60.0
    """Bound on waiting for the learner to accept a join (transfers use the learner's `timeout_s`)."""
    connect_timeout_s: float = 2.0
    """Bound on one attempt to reach the rendezvous (a learner that is down is retried, not waited for)."""
    retry_s: float = 1.0
    """Pause before rejoining after a failure."""
    idle_wait_s: float = 3600.0
    """How long one blocking wait for the next manifest lasts before it is simply renewed."""


@dataclass
class ReceivedWeights:
    """One verified version: buckets plus the manifest that maps names into them."""

    manifest: Manifest
    buffers: list[torch.Tensor]
    seconds: float
    """From the manifest's arrival to verification."""

    @property
    def version(self) -> int:
        return self.manifest.version

    @property
    def num_bytes(self) -> int:
        return self.manifest.total_bytes

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) views into the buckets; valid only while this object is referenced
        (its buffers are reused for a later version once it is garbage)."""
        return unpack(self.manifest, self.buffers)


class _BufferPool:
    """Host buffers of versions nobody holds any more, reused by size (on CPU, page faults of fresh
    memory cost several times the copy itself). GPU buffers are left to torch's caching allocator."""

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
    """Nothing to join yet (no address published, or nobody listening there); retry quietly."""


def broker_resolver(transport, names) -> Callable[[], str | None]:
    """A `resolve` callback reading the learner's address from `names.weight_sync_address` on the broker."""

    def resolve() -> str | None:
        value = transport.get_value(names.weight_sync_address)
        return value.decode() if value else None

    return resolve


class WeightReceiver:
    """Background receiver of whole, verified weight versions; see the module docstring."""

    def __init__(
        self,
        config: ReceiverConfig,
        *,
        apply: ApplyFn | None = None,
        resolve: Callable[[], str | None] | None = None,
        version: int = -1,
    ):
        """`version`: what the engine serves now (-1 unknown); the learner skips re-sending it."""
        if not config.address and resolve is None:
            raise ValueError("ReceiverConfig.address is empty and no resolve callback was given")
        self.config = config
        self.stats = ReceiverStats()
        self._apply = apply
        self._resolve = resolve
        self._version = version
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._mailbox: ReceivedWeights | None = None
        self._thread: threading.Thread | None = None
        self._pool = _BufferPool(torch.device(config.device))

    @property
    def version(self) -> int:
        """Newest version received and verified (applied, with an `apply` callback)."""
        return self._version

    def start(self) -> WeightReceiver:
        name = f"weight-receiver-{self.config.generator_id}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        return self

    def take(self) -> ReceivedWeights | None:
        """Mailbox mode: the newest verified version not yet taken, or None."""
        with self._cond:
            received, self._mailbox = self._mailbox, None
            return received

    def mark_served(self, version: int) -> None:
        """Mailbox mode: tell the receiver (and, on the next rejoin, the learner) what the engine serves."""
        self._version = version

    def wait_for(self, version: int, timeout_s: float) -> bool:
        """Block until a version >= `version` was delivered (True) or `timeout_s` passed (False)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._delivered >= version, timeout=timeout_s)

    def close(self) -> None:
        self._stop.set()
        waiting = self._waiting
        if waiting is not None:  # wake the thread's blocking wait through a second connection
            try:
                waiting[0].clone().set(waiting[1], Keys.ENDED + b"generator closing")
            except Exception:
                pass
        if self._thread is not None:
            self._thread.join(timeout=self.config.timeout_s + 5)
            self._thread = None

    # ------------------------------------------------------------------ thread
    _delivered = -1
    _waiting: tuple | None = None
    """(store, key) while the thread blocks waiting for its next manifest."""

    def _run(self) -> None:
        while not self._stop.is_set():
            session = None
            try:
                session = self._join()
                self._serve(*session)
            except _NoLearner as e:
                log.debug("weight receiver %s: %s", self.config.generator_id, e)
            except _SessionEnded as e:
                log.info("weight receiver %s: session ended (%s); rejoining", self.config.generator_id, e)
            except Exception as e:
                self.stats.last_error = f"{type(e).__name__}: {e}"
                log.warning(
                    "weight receiver %s: %s; rejoining", self.config.generator_id, self.stats.last_error
                )
            finally:
                if session is not None:
                    _abort(session[1])
            self._stop.wait(self.config.retry_s)

    def _join(self):
        """Connect to the rendezvous, take a ticket, wait for the learner's accept, build the group."""
        from torch.distributed import TCPStore

        address = self.config.address or (self._resolve() if self._resolve else None)
        if not address:
            raise _NoLearner("no learner address published yet")
        host, _, port = address.rpartition(":")
        connect = datetime.timedelta(seconds=self.config.connect_timeout_s)
        try:
            store = TCPStore(host, int(port), None, False, connect, wait_for_workers=False)
        except Exception as e:
            raise _NoLearner(f"no learner at {address}: {type(e).__name__}") from e
        store.set_timeout(datetime.timedelta(seconds=self.config.timeout_s))
        ticket = store.add(Keys.JOIN_SEQ, 1)
        request = JoinRequest(
            generator_id=self.config.generator_id,
            version=self._version,
            host=local_host_towards(host),
            device_uuid=device_uuid(self.config.device),
        )
        store.set(Keys.join(ticket), encode(request))
        accept = decode(store.get(Keys.accept(ticket)), JoinAccept)
        group = pair_group(accept.backend, store, accept.session, 1, accept.timeout_s, request.host)
        self.stats.joins += 1
        log.info(
            "weight receiver %s joined %s (session %d)", self.config.generator_id, address, accept.session
        )
        return store, group, accept

    def _serve(self, store, group, accept: JoinAccept) -> None:
        transfer = 0
        while not self._stop.is_set():
            manifest = self._next_manifest(store, accept.session, transfer)
            if manifest is None:
                return
            received = self._receive(group, accept, manifest)
            transfer += 1
            self._deliver(received)
            store.set(Keys.served(accept.session), str(self._version))

    def _next_manifest(self, store, session: int, transfer: int) -> Manifest | None:
        """Block (event-driven, no polling) until the learner writes the next manifest or ends the session."""
        key = Keys.manifest(session, transfer)
        self._waiting = (store, key)
        try:
            while not self._stop.is_set() and not store.check([key]):
                try:
                    store.wait([key], datetime.timedelta(seconds=self.config.idle_wait_s))
                except Exception:
                    store.check([key])  # raises if the learner is gone; else the wait just expired
        finally:
            self._waiting = None
        if self._stop.is_set():
            return None
        data = store.get(key)
        store.delete_key(key)
        if data.startswith(Keys.ENDED):
            raise _SessionEnded(data[len(Keys.ENDED) :].decode(errors="replace"))
        manifest = decode(data, Manifest)
        validate_manifest(manifest)
        return manifest

    def _receive(self, group, accept: JoinAccept, manifest: Manifest) -> ReceivedWeights:
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
        return ReceivedWeights(manifest, buffers, time.perf_counter() - t0)

    def _deliver(self, received: ReceivedWeights) -> None:
        """Hand a verified version over; its buffers return to the pool once nobody holds it."""
        if self._apply is not None:
            try:
                self._apply(received.named_tensors(), received.version)
            except Exception as e:
                self.stats.apply_failures += 1
                self.stats.last_error = f"apply failed: {type(e).__name__}: {e}"
                log.error(
                    "weight receiver %s: apply of version %d failed: %s",
                    self.config.generator_id,
                    received.version,
                    e,
                )
                return
            finally:
                self._pool.put(received.buffers)
        else:
            weakref.finalize(received, self._pool.put, received.buffers)
        self.stats.versions += 1
        self.stats.bytes += received.num_bytes
        self.stats.last_seconds = received.seconds
        self.stats.history = [*self.stats.history[-99:], received.version]
        with self._cond:
            self._version = received.version
            self._delivered = received.version
            if self._apply is None:
                self._mailbox = received
            self._cond.notify_all()


def _abort(group) -> None:
    """Release a session's group (its sockets close, so a learner sending to it fails at once)."""
    try:
        if group is not None:
            group.abort()
    except Exception:
        pass


def module_loader(model: torch.nn.Module) -> ApplyFn:
    """Reference `apply`: copy received checkpoint-named tensors into `model`, all or nothing.

    Every name must belong to the model and every shape must match before anything is copied;
    a mismatch raises WeightTransferError and leaves the model untouched.
    """
    by_checkpoint = {ckpt: name for name, ckpt in checkpoint_names(model).items()}
    targets = dict(named_tensors(model))

    def apply(tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        pairs = []
        for name, tensor in tensors:
            target = targets.get(by_checkpoint.get(name, ""))
            if target is None:
                raise WeightTransferError(f"version {version}: {name!r} is not a tensor of the model")
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightTransferError(
                    f"version {version}: {name} has shape {tuple(tensor.shape)}, model {tuple(target.shape)}"
                )
            pairs.append((target, tensor))
        with torch.no_grad():
            for target, tensor in pairs:
                target.copy_(tensor)

    return apply
