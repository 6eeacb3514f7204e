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
"""

from __future__ import annotations

import logging
import secrets
import time

import torch

from weights import ipc
from weights.config import WeightSyncConfig
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
        self, config: WeightSyncConfig, *, publish: Publish | None = None, rank: int = 0, device=None
    ):
        if rank != 0:
            raise WeightSyncError("weight_sync.transport = cuda-ipc needs a one-rank learner; use broadcast")
        super().__init__(config, publish=publish, rank=rank)
        self._wire: WireTensors | None = None
        self._buffer: torch.Tensor | None = None
        self._views: list[torch.Tensor] = []
        self._layout: ipc.IpcLayout | None = None
        self._version: int | None = None

    def _release(self) -> None:
        """The buffer is freed with its last reference (generators unmapped it when their sessions ended)."""
        self._layout = None
        self._buffer = None
        self._views = []

    def sync(self, model: torch.nn.Module, version: int, step: int = 0) -> SyncReport:
        """Pack the weights into the shared buffer as `version`; returns when generators can read it."""
        t0 = time.perf_counter()
        if self._wire is None or self._wire.model is not model:
            self._wire = WireTensors(model, self.config.send_dtype, self.config.layout, self.transport)
            self._allocate(self._wire)
        tensors = self._wire.tensors()
        with self._membership.lock:
            members = self._membership.live()
            locked = self._lock_all(members)
            t1 = time.perf_counter()
            self._pack(tensors)
            if self._buffer.is_cuda:
                torch.cuda.current_stream(self._buffer.device).synchronize()
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
            if v.dtype == t.dtype and not isinstance(t, DTensor):
                plain_v.append(v)
                plain_t.append(t)
            else:
                rest.append((v, t))
        copy_all(plain_v, plain_t)
        with torch.no_grad():
            for v, t in rest:
                v.copy_(full(t.detach()))

    def _lock_all(self, members: list[Member]) -> list[Member]:
        """Take every member's lock (waiting out one that is copying); drop the ones that time out."""
        store, locked = self._membership.store, []
        for m in members:
            deadline = time.monotonic() + self.config.lock_timeout_s
            while True:
                got = store.compare_set(Keys.lock(m.session), Keys.FREE, Keys.WRITER)
                if got == Keys.WRITER:
                    locked.append(m)
                    break
                if got == Keys.DROPPED or time.monotonic() > deadline:
                    reason = f"held the buffer's lock longer than {self.config.lock_timeout_s} s"
                    self._membership.drop(m, reason)
                    break
                time.sleep(self.config.poll_s)
        return locked

    def _end(self, member: Member, reason: str) -> None:
        store = self._membership.store
        if store is not None:
            store.set(Keys.lock(member.session), Keys.DROPPED)

    def _admit(self, store, ticket: int, request: JoinRequest) -> None:
        """A new session: its lock, what it serves, and (once allocated) the layout and current version."""
        with self._membership.lock:
            store.set(Keys.lock(ticket), Keys.FREE)
            store.set(Keys.served(ticket), str(request.version))
            if self._layout is not None:
                self._write_layout(store, ticket)
            if self._version is not None:
                store.set(Keys.version(ticket), str(self._version))
            store.set(
                Keys.accept(ticket), encode(JoinAccept(session=ticket, timeout_s=self.config.timeout_s))
            )
            self._membership.add(Member(request.generator_id, ticket))
