"""`cuda-ipc` sender: one packed buffer on the learner's GPU that generators on this host read in place.

When the learner and a generator engine share a GPU, NCCL refuses the pair and gloo would move every
byte through host memory twice. Here the learner owns ONE flat buffer holding a whole version (in
the wire dtype, bfloat16 by default on CUDA) and shares it through a CUDA IPC handle; every admitted
generator maps it once. A sync is one device-to-device pack (16.6 GB for 7B: milliseconds of HBM
bandwidth); the generator's engine then loads straight from the mapped buffer.

Generators join through the same rendezvous as `broadcast` (token checked); per session the store
holds a lock, the version in the buffer and the `IpcLayout` (written for admitted sessions only).
Before packing, the learner takes every member's lock ("free" -> "writer"), so a generator never
reads a half-written version; a generator holds its lock ("reader") only from `poll()` to
`mark_served()`, while its engine copies the weights in. One that holds it longer than
`lock_timeout_s` is dropped ("dropped"; it rejoins by itself). A generator that joins late reads
the current version at once. Needs a one-rank learner on CUDA.

Parameters in the buffer (`weight_sync.transport.params_in_buffer`, the default): after the first pack, every
plain parameter whose dtype is the wire's (bf16 parameters: master weights in host memory) is pointed at its
view of the buffer, as FSDP1 did with its flat parameter. The GPU then holds the weights once (2 bytes a
parameter less: 15.4 GiB at 7B) and a sync copies only what did not move. The optimizer then writes
straight into what generators read, so the learner takes every lock before its first write of a version
(`begin_write`, called by learner.update before AdamW) and holds it until `sync` publishes the version:
a generator never copies a half-updated model, and one that polls meanwhile gets nothing (as while a pack
runs). A generator admitted meanwhile starts locked out too. So a generator takes version v between its
sync and the learner's next AdamW (the next step's first update), no longer: one that polls later waits
for v + 1.
"""

from __future__ import annotations

import logging
import secrets
import time

import torch

from weights import ipc
from weights.adapter import wire_tensors
from weights.config import CudaIpcTransport, WeightSenderConfig
from weights.inplace import copy_all
from weights.interface import SyncReport, WeightSender
from weights.manifest import WireTensors, full, one_buffer, tensor_view
from weights.membership import Member, Publish
from weights.protocol import JoinAccept, JoinRequest, Keys, WeightSyncError, encode
from weights.vllm_layout import row_slices

log = logging.getLogger(__name__)


class IpcSender(WeightSender):
    """Learner side of cuda-ipc (see the module docstring)."""

    transport = "cuda-ipc"

    def __init__(
        self, config: WeightSenderConfig, *, publish: Publish | None = None, rank: int = 0, device=None
    ):
        if rank != 0:
            raise WeightSyncError("weight_sync.transport cuda-ipc needs a one-rank learner; use broadcast")
        super().__init__(config, publish=publish, rank=rank)
        self.options: CudaIpcTransport = config.transport
        self._wire: WireTensors | None = None
        self._buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._layout: ipc.IpcLayout | None = None
        self._version: int | None = None
        self._in_buffer = 0
        """Parameters that live in the buffer (module docstring)."""
        self._writing: list[Member] | None = None
        """The members whose lock `begin_write` took for the optimizer's writes, until the next sync."""

    def begin_write(self) -> float:
        """With parameters in the buffer: take every generator's lock before the optimizer writes them
        (waiting out a reader; dropping one that holds it past `lock_timeout_s`), kept until the next `sync`.
        A no-op otherwise, and while already held. Returns the seconds it waited."""
        if not self._in_buffer or self._writing is not None:
            return 0.0
        t0 = time.perf_counter()
        with self._membership.lock:
            self._writing = self._lock_all(self._membership.live())
        return time.perf_counter() - t0

    def _release(self) -> None:
        """The buffer is freed with its last reference (generators unmapped it when their sessions ended)."""
        self._layout = None
        self._buffer = None
        self._views = []

    def sync(self, model: torch.nn.Module, version: int, step: int = 0) -> SyncReport:
        """Pack the weights into the shared buffer as `version`; returns when generators can read it."""
        t0 = time.perf_counter()
        new = self._wire is None or self._wire.model is not model
        if new:
            self._wire = wire_tensors(model, self.config.send_dtype, self.config.layout, self.transport)
            self._allocate(self._wire)
        tensors = self._wire.tensors()
        with self._membership.lock:
            members = self._membership.live()
            held, self._writing = self._writing, None
            locked = [m for m in held if m.alive] if held is not None else self._lock_all(members)
            t1 = time.perf_counter()
            self._pack(tensors)
            if new:
                self._in_buffer = self._params_into_buffer(tensors) if self.options.params_in_buffer else 0
            if self._buffer.is_cuda:  # every stream's writes (the optimizer copies on streams of its own)
                torch.cuda.synchronize(self._buffer.device)
            self._version = version
            store = self._membership.store
            for m in locked:  # one request: a reader never sees the lock free before the version
                store.multi_set([Keys.version(m.session), Keys.lock(m.session)], [str(version), Keys.FREE])
            t2 = time.perf_counter()
        return SyncReport(
            version,
            step,
            self._layout.nbytes,
            t2 - t0,
            sent_to=[m.generator_id for m in locked],
            dropped=[m.generator_id for m in members if not m.alive],
            pack_seconds=t2 - t1,
            wait_seconds=t1 - t0,
        )

    def _allocate(self, wire: WireTensors) -> None:
        """The buffer, a view per model tensor (rows of a stacked wire tensor in layout vllm), the layout."""
        layout = one_buffer(wire.entries)
        device = next(iter(wire.tensors())).device
        self._buffer = torch.empty(layout.bucket_nbytes[0], dtype=torch.uint8, device=device)
        manifest = wire.manifest(layout, -1, 0, checksums=False)
        slices = [
            row_slices(tensor_view(self._buffer, spec), manifest.parts.get(spec.name) or [(spec.name, 0)])
            for spec in layout.tensors
        ]
        self._views = [slices[w][k] for w, k in wire.slots]
        self._layout = ipc.IpcLayout(
            layout_id=secrets.randbits(62),
            nbytes=layout.bucket_nbytes[0],
            handle=ipc.share(self._buffer),
            manifest=manifest,
        )
        with self._membership.lock:
            for m in self._membership.live():
                self._write_layout(self._membership.store, m.session)
        log.info(
            "cuda-ipc weight buffer: %d tensors, %.2f GB", len(layout.tensors), self._layout.nbytes / 1e9
        )

    def _write_layout(self, store, session: int) -> None:
        store.set(Keys.layout(session), encode(self._layout))
        store.set(Keys.layout_id(session), str(self._layout.layout_id))

    def _pack(self, tensors: list[torch.Tensor]) -> None:
        """Copy (and cast) every tensor into its view: plain same-dtype tensors together (`copy_all`),
        FSDP2 shards gathered and copied one at a time (never a second full copy of the model)."""
        from torch.distributed.tensor import DTensor

        plain_v, plain_t, rest = [], [], []
        for v, t in zip(self._views, tensors, strict=True):
            if isinstance(t, DTensor) or v.dtype != t.dtype:
                rest.append((v, t))
            elif t.data_ptr() != v.data_ptr():  # not a parameter that lives in the buffer
                plain_v.append(v)
                plain_t.append(t)
        copy_all(plain_v, plain_t)
        with torch.no_grad():
            for v, t in rest:
                v.copy_(full(t.detach()))

    def _params_into_buffer(self, tensors: list[torch.Tensor]) -> int:
        """Point every plain parameter of the wire's dtype at its view (just packed: same values), so the
        buffer is the parameter (module docstring); returns how many now live there."""
        from torch.distributed.tensor import DTensor

        moved = 0
        for v, t in zip(self._views, tensors, strict=True):
            plain = isinstance(t, torch.nn.Parameter) and not isinstance(t, DTensor)
            if plain and t.dtype == v.dtype and t.device == v.device and v.is_contiguous():
                t.data = v
                moved += 1
        if moved:
            log.info("cuda-ipc: %d of %d parameters live in the weight buffer", moved, len(tensors))
        return moved

    def _lock_all(self, members: list[Member]) -> list[Member]:
        """Take every member's lock (waiting out one that is copying); drop the ones that time out."""
        store, locked = self._membership.store, []
        for m in members:
            deadline = time.monotonic() + self.options.lock_timeout_s
            while True:
                got = store.compare_set(Keys.lock(m.session), Keys.FREE, Keys.WRITER)
                if got == Keys.WRITER:
                    locked.append(m)
                    break
                if got == Keys.DROPPED or time.monotonic() > deadline:
                    reason = f"held the buffer's lock longer than {self.options.lock_timeout_s} s"
                    self._membership.drop(m, reason)
                    break
                time.sleep(self.options.poll_s)
        return locked

    def _end(self, member: Member, reason: str) -> None:
        store = self._membership.store
        if store is not None:
            store.set(Keys.lock(member.session), Keys.DROPPED)

    def _admit(self, store, ticket: int, request: JoinRequest) -> None:
        """A new session: its lock, what it serves, and (once allocated) the layout and current version."""
        with self._membership.lock:
            member = Member(request.generator_id, ticket)
            store.set(Keys.lock(ticket), Keys.FREE if self._writing is None else Keys.WRITER)
            if self._writing is not None:  # the optimizer is writing the buffer: locked out until the sync
                self._writing.append(member)
            store.set(Keys.served(ticket), str(request.version))
            if self._layout is not None:
                self._write_layout(store, ticket)
            if self._version is not None:
                store.set(Keys.version(ticket), str(self._version))
            store.set(
                Keys.accept(ticket), encode(JoinAccept(session=ticket, timeout_s=self.config.timeout_s))
            )
            self._membership.add(member)
