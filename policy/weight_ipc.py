"""CUDA-IPC weight sync for a learner and generators that share one GPU: no copy leaves the device.

When the learner and a generator engine run on the same GPU (two processes), NCCL refuses the
pair and the bucketed gloo path (policy/weight_transfer.py) would move every byte through host
memory twice. Here the learner owns ONE flat buffer on the GPU holding a whole policy version in
checkpoint layout (`plan_layout` with a single bucket, in the sync dtype, bf16 by default) and
shares it once through a CUDA IPC handle; every generator maps it into its own process. A sync is
then one device-to-device pack on the learner (16.6 GB for 7B: a few milliseconds of HBM
bandwidth) and, on the generator, a `load_weights` that reads straight from the mapped buffer.

Control goes through a TCPStore the learner hosts ("host:port", as the bucketed path):
  ipc/layout           msgpack `IpcLayout`: the manifest (names, dtypes, shapes, offsets) + the IPC handle
  ipc/version          newest version in the buffer
  ipc/readers          number of registered generators; ipc/reader/<i> its id, ipc/lock/<i> its lock
  ipc/served/<i>       the version generator i serves
Each generator has its own lock key: "free", "reader" (it is copying out of the buffer),
"writer" (the learner is packing) or "dropped" (it missed `lock_timeout_s`; it re-registers).
The learner takes every live generator's lock before packing, so a generator never reads a
half-written version and the learner never waits for a generation batch: a generator holds its
lock only from `take()` to `mark_served()`, i.e. while the engine copies the weights in.

Sender and receiver have the surface of learner/weight_sender.py and generator/weight_receiver.py
(`start/sync/members/close`, `start/take/mark_served/wait_for/close`), so either plugs in where
the bucketed one does. Only CUDA tensors can be shared; on CPU use the bucketed path.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import msgspec
import torch

from policy.weight_transfer import (
    Manifest,
    ReceiverStats,
    WeightTransferError,
    checkpoint_names,
    dtype_from_name,
    named_tensors,
    plan_layout,
    tensor_view,
)

log = logging.getLogger(__name__)

FREE, READER, WRITER, DROPPED = b"free", b"reader", b"writer", b"dropped"


class IpcHandle(msgspec.Struct, frozen=True):
    """What `torch.UntypedStorage._share_cuda_()` returns, as plain fields (no pickle)."""

    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class IpcLayout(msgspec.Struct, kw_only=True):
    """The shared buffer: its handle, size and the manifest that places every tensor in it."""

    layout_id: int
    nbytes: int
    handle: IpcHandle
    manifest: Manifest


@dataclass
class IpcSenderConfig:
    """CUDA-IPC weight sync settings of the learner."""

    host: str = "127.0.0.1"
    """Address of the control store (generators on this host connect to it)."""
    port: int = 0
    """Port of the control store; 0 picks a free one."""
    dtype: str = "bfloat16"
    """dtype of floating-point tensors in the shared buffer (what the engine serves); "" keeps each dtype."""
    lock_timeout_s: float = 30.0
    """A generator holding its lock longer than this is dropped (it re-registers by itself)."""
    poll_s: float = 0.0005
    """Pause between lock attempts."""


@dataclass
class IpcSyncReport:
    version: int
    step: int
    num_bytes: int
    seconds: float
    pack_seconds: float = 0.0
    lock_wait_seconds: float = 0.0
    sent_to: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


def share(tensor: torch.Tensor) -> IpcHandle:
    """The IPC handle of `tensor`'s storage (the tensor must stay alive while anyone maps it)."""
    if not tensor.is_cuda:
        raise WeightTransferError("CUDA IPC needs a CUDA tensor")
    fields = tensor.untyped_storage()._share_cuda_()
    return IpcHandle(
        int(fields[0]),
        bytes(fields[1]),
        int(fields[2]),
        int(fields[3]),
        bytes(fields[4]),
        int(fields[5]),
        bytes(fields[6]),
        bool(fields[7]),
    )


def open_shared(h: IpcHandle, nbytes: int) -> torch.Tensor:
    """A uint8 view of another process's shared buffer (mapped into this process)."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        h.device,
        h.handle,
        h.storage_bytes,
        h.storage_offset,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{h.device}").set_(storage, 0, (nbytes,), (1,))


def _store(host: str, port: int, master: bool, timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(host, port, None, master, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


class IpcWeightSender:
    """Learner side: one shared buffer, packed in place at every sync (see the module docstring)."""

    def __init__(self, config: IpcSenderConfig, *, publish: Callable[[str], None] | None = None):
        self.config = config
        self._publish = publish
        self._store = None
        self._buffer: torch.Tensor | None = None
        self._layout: IpcLayout | None = None
        self._names: dict[str, str] | None = None
        self._dropped: set[int] = set()

    def start(self) -> str:
        """Bind the control store; returns (and publishes) "host:port"."""
        self._store = _store(self.config.host, self.config.port, True, 60.0)
        self._store.add("ipc/readers", 0)
        if self._publish is not None:
            self._publish(self.address)
        return self.address

    @property
    def address(self) -> str:
        if self._store is None:
            raise RuntimeError("IpcWeightSender.start() was not called")
        return f"{self.config.host}:{self._store.port}"

    def sync(self, model: torch.nn.Module, version: int, step: int = 0) -> IpcSyncReport:
        """Pack `model`'s weights into the shared buffer as `version`; returns once generators can read it."""
        t0 = time.perf_counter()
        pairs = list(named_tensors(model))  # FSDP2 shards: gathered one at a time while packing
        if self._layout is None:
            self._allocate(model, pairs)
        readers = self._readers()
        locked, dropped = self._lock_all(readers)
        t1 = time.perf_counter()
        self._pack([t for _, t in pairs])
        if self._buffer.is_cuda:
            torch.cuda.current_stream(self._buffer.device).synchronize()
        self._store.set("ipc/version", str(version))
        for i in locked:
            self._store.set(f"ipc/lock/{i}", FREE)
        t2 = time.perf_counter()
        return IpcSyncReport(
            version,
            step,
            self._layout.nbytes,
            t2 - t0,
            pack_seconds=t2 - t1,
            lock_wait_seconds=t1 - t0,
            sent_to=[readers[i] for i in locked],
            dropped=dropped,
        )

    def members(self) -> dict[str, int]:
        """Registered generators -> the version each serves (-1 before its first)."""
        out = {}
        for i, gid in self._readers().items():
            key = f"ipc/served/{i}"
            out[gid] = int(self._store.get(key)) if self._store.check([key]) else -1
        return out

    def close(self) -> None:
        """Stop serving: generators see the version key no more; the buffer is released with this object."""
        self._store = None
        self._layout = None
        self._buffer = None

    # ------------------------------------------------------------------ internals
    def _allocate(self, model, pairs) -> None:
        self._names = checkpoint_names(model)
        cast = dtype_from_name(self.config.dtype) if self.config.dtype else None
        entries = [
            (self._names[n], cast if cast is not None and t.is_floating_point() else t.dtype, tuple(t.shape))
            for n, t in pairs
        ]
        total = sum(-(-t.numel() * dt.itemsize // 16) * 16 for (_, dt, _), (_, t) in zip(entries, pairs))
        layout = plan_layout(entries, max(total, 16))
        if len(layout.bucket_nbytes) != 1:
            raise WeightTransferError("layout does not fit one buffer")
        device = pairs[0][1].device
        self._buffer = torch.empty(layout.bucket_nbytes[0], dtype=torch.uint8, device=device)
        manifest = Manifest(
            version=-1, tensors=layout.tensors, bucket_nbytes=layout.bucket_nbytes, checksums=False
        )
        self._views = [tensor_view(self._buffer, spec) for spec in layout.tensors]
        layout_id = int(time.time() * 1000)
        self._layout = IpcLayout(
            layout_id=layout_id, nbytes=layout.bucket_nbytes[0], handle=share(self._buffer), manifest=manifest
        )
        self._store.set("ipc/layout", msgspec.msgpack.encode(self._layout))
        self._store.set("ipc/layout_id", str(layout_id))
        log.info(
            "CUDA-IPC weight buffer: %d tensors, %.2f GB", len(layout.tensors), layout.bucket_nbytes[0] / 1e9
        )

    def _pack(self, tensors: list[torch.Tensor]) -> None:
        """Copy (and cast) every tensor into its view: plain same-dtype tensors in one foreach copy,
        FSDP2 shards gathered and copied one at a time (never a second full copy of the model)."""
        from torch.distributed.tensor import DTensor

        same = [
            (v, t) for v, t in zip(self._views, tensors) if v.dtype == t.dtype and not isinstance(t, DTensor)
        ]
        rest = [(v, t) for v, t in zip(self._views, tensors) if v.dtype != t.dtype or isinstance(t, DTensor)]
        with torch.no_grad():
            if same:
                torch._foreach_copy_([v for v, _ in same], [t.detach() for _, t in same])
            for v, t in rest:
                v.copy_(_full(t.detach()))

    def _readers(self) -> dict[int, str]:
        n = int(self._store.add("ipc/readers", 0))
        out = {}
        for i in range(n):
            if i in self._dropped:
                continue
            key = f"ipc/reader/{i}"
            if self._store.check([key]):
                out[i] = self._store.get(key).decode()
        return out

    def _lock_all(self, readers: dict[int, str]) -> tuple[list[int], list[str]]:
        """Take every live reader's lock (waiting out a reader that is copying); drop the ones that time out."""
        locked, dropped = [], []
        for i in readers:
            deadline = time.monotonic() + self.config.lock_timeout_s
            while True:
                got = self._store.compare_set(f"ipc/lock/{i}", FREE, WRITER)
                if got == WRITER:
                    locked.append(i)
                    break
                if got == DROPPED or time.monotonic() > deadline:
                    self._store.set(f"ipc/lock/{i}", DROPPED)
                    self._dropped.add(i)
                    dropped.append(readers[i])
                    log.warning(
                        "CUDA-IPC weight sync: generator %s held its lock > %.1f s; dropped",
                        readers[i],
                        self.config.lock_timeout_s,
                    )
                    break
                time.sleep(self.config.poll_s)
        return locked, dropped


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@dataclass
class IpcReceived:
    """One version, readable in place in the shared buffer until `mark_served` releases it.

    `layout` is the reference alone (handle + manifest, plain data): an engine whose model lives in
    another process (vLLM's engine core) passes it there and maps the buffer on that side. `buffer`
    maps it in THIS process, on first use only (so such an engine's front end never touches CUDA)."""

    manifest: Manifest
    buffer_or_map: torch.Tensor | Callable[[], torch.Tensor]
    version: int
    seconds: float = 0.0
    layout: IpcLayout | None = None

    @property
    def buffer(self) -> torch.Tensor:
        if callable(self.buffer_or_map):
            self.buffer_or_map = self.buffer_or_map()
        return self.buffer_or_map

    @property
    def num_bytes(self) -> int:
        return self.manifest.total_bytes

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec in self.manifest.tensors:
            yield spec.name, tensor_view(self.buffer, spec)


class IpcWeightReceiver:
    """Generator side: map the learner's buffer and hand out new versions (mailbox or `apply` callback)."""

    def __init__(
        self,
        generator_id: str,
        address: str = "",
        *,
        resolve: Callable[[], str | None] | None = None,
        apply: Callable[[Iterable[tuple[str, torch.Tensor]], int], None] | None = None,
        version: int = -1,
        poll_s: float = 0.002,
        connect_timeout_s: float = 2.0,
    ):
        if not address and resolve is None:
            raise ValueError("IpcWeightReceiver needs an address or a resolve callback")
        self.generator_id = generator_id
        self.address = address
        self.stats = ReceiverStats()
        self._resolve = resolve
        self._apply = apply
        self._version = version
        self._poll_s = poll_s
        self._connect_timeout_s = connect_timeout_s
        self._store = None
        self._index: int | None = None
        self._layout: IpcLayout | None = None
        self._buffer: torch.Tensor | None = None
        self._holding = False
        self._taken = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return self._version

    def start(self) -> IpcWeightReceiver:
        """With an `apply` callback: a thread applies every new version; without: nothing to start."""
        if self._apply is not None and self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"ipc-receiver-{self.generator_id}", daemon=True
            )
            self._thread.start()
        return self

    def take(self) -> IpcReceived | None:
        """The newest version if it is newer than the one served, with this generator's lock held
        (release it with `mark_served`); None when nothing new, the learner is packing right now, or
        the learner is gone (the next call reconnects through `resolve` / the address)."""
        with self._lock:
            if self._holding:
                raise RuntimeError("take() again before mark_served()")
            try:
                return self._take()
            except (RuntimeError, OSError) as e:  # torch.distributed.DistError (store gone) is a RuntimeError
                self.stats.failures += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                log.warning(
                    "CUDA-IPC receiver %s: learner store unreachable (%s); will reconnect",
                    self.generator_id,
                    type(e).__name__,
                )
                self._disconnect()
                return None

    def _take(self) -> IpcReceived | None:
        if not self._connect():
            return None
        t0 = time.perf_counter()
        version = self._latest()
        if version is None or version <= max(self._version, self._taken):
            return None
        got = self._store.compare_set(f"ipc/lock/{self._index}", FREE, READER)
        if got == DROPPED:
            self._index = None  # the learner gave up on us: register again next time
            return None
        if got != READER:
            return None  # the learner is writing: try again next step
        self._holding = True
        version = self._latest()  # stable while we hold the lock
        self._taken = version
        self._refresh_layout()
        return IpcReceived(
            self._layout.manifest, self._mapped, version, time.perf_counter() - t0, layout=self._layout
        )

    def mark_served(self, version: int) -> None:
        """The engine now serves `version` (or kept its old one): wait for its copies, release the lock."""
        with self._lock:
            self._version = version
            try:
                if self._holding:
                    if (
                        self._buffer is not None and self._buffer.is_cuda
                    ):  # mapped here: our copies must be done
                        torch.cuda.synchronize(self._buffer.device)
                    self._holding = False
                    if self._store.compare_set(f"ipc/lock/{self._index}", READER, FREE) == DROPPED:
                        self._index = (
                            None  # held too long: the learner dropped us; register again on the next take
                        )
                if self._store is not None and self._index is not None:
                    self._store.set(f"ipc/served/{self._index}", str(self._version))
            except (RuntimeError, OSError):
                self._disconnect()

    def wait_for(self, version: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self._version < version:
            if time.monotonic() > deadline:
                return False
            time.sleep(self._poll_s)
        return True

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if self._holding and self._store is not None:
            self._store.set(f"ipc/lock/{self._index}", FREE)
        self._buffer = None
        self._store = None

    # ------------------------------------------------------------------ internals
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                received = self.take()
            except Exception as e:
                self.stats.failures += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                received = None
            if received is None:
                self._stop.wait(self._poll_s)
                continue
            served = self._version
            try:
                self._apply(received.named_tensors(), received.version)
                served = received.version
                self.stats.versions += 1
                self.stats.bytes += received.num_bytes
                self.stats.history = [*self.stats.history[-99:], received.version]
            except Exception as e:
                self.stats.apply_failures += 1
                self.stats.last_error = f"apply failed: {type(e).__name__}: {e}"
                log.error(
                    "CUDA-IPC receiver %s: apply of version %d failed: %s",
                    self.generator_id,
                    received.version,
                    e,
                )
            finally:
                self.mark_served(served)

    def _connect(self) -> bool:
        """Connect to the learner's store and register; False while there is nothing to connect to."""
        if self._store is None:
            address = self.address or (self._resolve() if self._resolve else None)
            if not address:
                return False
            host, _, port = address.rpartition(":")
            try:
                self._store = _store(host, int(port), False, self._connect_timeout_s)
            except Exception:
                return False
            self._store.set_timeout(datetime.timedelta(seconds=60))
        if self._index is None:
            index = int(self._store.add("ipc/readers", 1)) - 1
            self._store.set(f"ipc/lock/{index}", FREE)
            self._store.set(f"ipc/served/{index}", str(self._version))
            self._store.set(f"ipc/reader/{index}", self.generator_id)
            self._index = index
            self.stats.joins += 1
        return True

    def _disconnect(self) -> None:
        """Forget the learner's store (it went away); the mapped buffer is re-mapped on the next layout."""
        self._store = None
        self._index = None
        self._holding = False
        self._layout = None
        self._buffer = None

    def _latest(self) -> int | None:
        return int(self._store.get("ipc/version")) if self._store.check(["ipc/version"]) else None

    def _refresh_layout(self) -> None:
        """Read the layout on first use, and again only if the learner re-allocated the buffer (which is
        then mapped anew, lazily: see `_mapped`)."""
        layout_id = int(self._store.get("ipc/layout_id"))
        if self._layout is not None and layout_id == self._layout.layout_id:
            return
        self._layout = msgspec.msgpack.decode(self._store.get("ipc/layout"), type=IpcLayout)
        self._buffer = None

    def _mapped(self) -> torch.Tensor:
        """The shared buffer mapped into this process (once per layout)."""
        if self._buffer is None:
            self._buffer = open_shared(self._layout.handle, self._layout.nbytes)
        return self._buffer
