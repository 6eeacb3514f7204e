"""`broadcast` sender: push each version to every generator as a few large bucket collectives.

The learner is rank 0 of one 2-rank process group per connected generator (NCCL between GPUs, gloo
on CPU), separate from any training group. Per sync: a `Manifest` per generator through the
rendezvous store, then the packed buckets and a checksum trailer as broadcasts on every generator's
group at once, two buckets in flight.

Membership is dynamic: the admission thread builds a joining generator's group at any time and,
with `keep_last`, immediately sends it the last synced version from the packed copy, so a
(re)started generator never waits for the next optimizer step. A generator that fails or misses
`timeout_s` on any bucket is dropped; the sync carries on with the rest.

With an FSDP2 model the full tensors are gathered (`DTensor.full_tensor()`) one bucket at a time on
every training rank; only rank 0 sends. Without `keep_last`, a bucket holding one big tensor is sent
from the tensor's own memory (no packing copy). A generator on the learner's own GPU cannot pair
with it over NCCL; it is served over gloo through host memory (correct, slow: use cuda-ipc there).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import torch

from weights.adapter import wire_tensors
from weights.config import BroadcastTransport, WeightSenderConfig
from weights.interface import SyncReport, WeightSender
from weights.manifest import WireTensors, checksum, pack_bucket, plan_layout, trailer
from weights.membership import Member, Publish
from weights.protocol import JoinAccept, JoinRequest, Keys, Manifest, encode
from weights.rendezvous import abort, device_uuid, pair_group, wait_work

log = logging.getLogger(__name__)


@dataclass
class _Kept:
    manifest: Manifest
    buffers: list[torch.Tensor]
    checksums: list[int]


class BroadcastSender(WeightSender):
    """Rank 0 hosts the rendezvous and sends; other training ranks only join the FSDP gathers."""

    transport = "broadcast"

    def __init__(
        self,
        config: WeightSenderConfig,
        *,
        publish: Publish | None = None,
        rank: int = 0,
        device: torch.device | str = "cpu",
    ):
        """`device`: where buckets are packed: a CUDA device selects NCCL, the CPU gloo."""
        super().__init__(config, publish=publish, rank=rank)
        self.options: BroadcastTransport = config.transport
        self._device = torch.device(device)
        self._backend = "nccl" if self._device.type == "cuda" else "gloo"
        self._uuid = device_uuid(self._device)
        self._wire: WireTensors | None = None
        self._kept: _Kept | None = None
        self._staging: list[torch.Tensor] = []
        """Bucket buffers reused across syncs (all buckets with keep_last, else two that alternate)."""

    def _release(self) -> None:
        self._kept = None

    def sync(self, model: torch.nn.Module, version: int, step: int = 0) -> SyncReport:
        """Returns after every live generator received the whole version (or was dropped), not after it
        applied it. Collective over the training ranks when the model is FSDP2-sharded."""
        t0 = time.perf_counter()
        if self._wire is None or self._wire.model is not model:
            self._wire = wire_tensors(model, self.config.send_dtype, self.config.layout, self.transport)
        tensors = self._wire.tensors()
        layout = plan_layout(self._wire.entries, self.options.bucket_bytes)
        if self._rank != 0:
            for b in range(len(layout.bucket_nbytes)):
                for i in layout.bucket_members(b):
                    self._wire.gather(tensors, i)
            return SyncReport(version, step, 0, time.perf_counter() - t0)
        manifest = self._wire.manifest(layout, version, step, self.options.checksums)
        keep = self.options.keep_last
        with self._membership.lock:
            self._kept = None
            members = self._membership.live()
            buffers: list[torch.Tensor] = []

            def produce(b: int) -> tuple[torch.Tensor, int]:
                idx = layout.bucket_members(b)
                specs, whole = (
                    [manifest.tensors[i] for i in idx],
                    [self._wire.gather(tensors, i) for i in idx],
                )
                nbytes = manifest.bucket_nbytes[b]
                buf = None if keep else _unpacked(whole, specs, nbytes, self._device)
                if buf is None:
                    buf = self._bucket_buffer(b, nbytes)
                    pack_bucket(buf, specs, whole)
                    buffers.append(buf)
                return buf, checksum(buf) if self.options.checksums else 0

            sums = self._stream(members, manifest, produce)
            if keep:
                self._kept = _Kept(manifest, buffers, sums)
        sent = [m.generator_id for m in members if m.alive]
        dropped = [m.generator_id for m in members if not m.alive]
        seconds = time.perf_counter() - t0
        return SyncReport(version, step, manifest.total_bytes, seconds, sent, dropped, pack_seconds=seconds)

    def _bucket_buffer(self, b: int, nbytes: int) -> torch.Tensor:
        """One buffer per bucket when the version is kept, else one of two alternating staging buffers;
        both are reused from sync to sync (fresh host memory costs page faults that outweigh the copy)."""
        slot = b if self.options.keep_last else b % 2
        while len(self._staging) <= slot:
            self._staging.append(torch.empty(0, dtype=torch.uint8, device=self._device))
        if self._staging[slot].numel() < nbytes:
            self._staging[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return self._staging[slot][:nbytes]

    def _stream(self, members: list[Member], manifest: Manifest, produce) -> list[int]:
        """Announce `manifest`, then send every bucket (two in flight) and the trailer; returns the checksums.
        `produce(b)` packs bucket b only after the bucket two before it is done (two staging buffers)."""
        for m in members:
            self._announce(m, manifest)
        inflight: collections.deque = collections.deque()
        sums = []
        for b in range(len(manifest.bucket_nbytes)):
            if len(inflight) == 2:
                self._await_transfers(inflight.popleft()[1])
            buf, total = produce(b)
            sums.append(total)
            inflight.append((buf, self._launch(members, buf)))  # buf stays referenced until sent
        while inflight:
            self._await_transfers(inflight.popleft()[1])
        self._await_transfers(self._launch(members, trailer(manifest.version, sums, self._device)))
        return sums

    def _announce(self, member: Member, manifest: Manifest) -> None:
        try:
            self._membership.store.set(Keys.manifest(member.session, member.transfers), encode(manifest))
            member.transfers += 1
        except Exception as e:  # the store is ours; this only fails when we are shutting down
            self._membership.drop(member, f"manifest not written: {e}")

    def _launch(self, members: list[Member], buf: torch.Tensor) -> list:
        works = []
        for m in members:
            if m.alive:
                try:
                    works.append((m, m.group.broadcast(buf, 0)))
                except Exception as e:
                    self._membership.drop(m, f"send failed: {e}")
        return works

    def _await_transfers(self, works: list) -> None:
        """Wait for each live member's broadcast of `works`; a member whose transfer fails is dropped."""
        for m, work in works:
            if m.alive:
                try:
                    wait_work(work, m.backend, self.config.timeout_s)
                except Exception as e:
                    self._membership.drop(m, f"transfer failed: {e}")

    def _end(self, member: Member, reason: str) -> None:
        """Wake a receiver waiting for its next manifest; one mid-transfer fails on the aborted group."""
        store = self._membership.store
        if store is not None:
            store.set(Keys.manifest(member.session, member.transfers), Keys.ENDED + reason[:200].encode())
        abort(member.group)

    def _admit(self, store, ticket: int, request: JoinRequest) -> None:
        """Build the joiner's group, send it the kept version if it lacks it, make it a member."""
        backend = self._backend_for(request)
        store.set(
            Keys.accept(ticket),
            encode(JoinAccept(session=ticket, backend=backend, timeout_s=self.config.timeout_s)),
        )
        group = pair_group(backend, store, ticket, 0, self.config.timeout_s, self.config.host)
        member = Member(request.generator_id, ticket, group, backend)
        with self._membership.lock:
            kept = self._kept
            if kept is not None and kept.manifest.version != request.version:
                self._stream([member], kept.manifest, lambda b: (kept.buffers[b], kept.checksums[b]))
            self._membership.add(member)

    def _backend_for(self, request: JoinRequest) -> str:
        """NCCL, except gloo for a generator on this learner's own GPU (NCCL cannot pair two ranks on one
        device; gloo stages the CUDA buffers through host memory: correct but slow)."""
        if self._backend == "nccl" and request.device_uuid and request.device_uuid == self._uuid:
            log.warning(
                "weight sync: generator %s shares this learner's GPU; NCCL cannot pair them, sending "
                "through gloo (transport cuda-ipc is the fast path on a shared GPU)",
                request.generator_id,
            )
            return "gloo"
        return self._backend


def _unpacked(
    whole: list[torch.Tensor], specs: list, nbytes: int, device: torch.device
) -> torch.Tensor | None:
    """A bucket that holds one big tensor goes out as that tensor's own bytes (no packing copy) when
    nothing needs converting: same device and dtype, contiguous, and a size that needs no padding."""
    if len(whole) != 1:
        return None
    tensor, spec = whole[0].detach(), specs[0]
    if (
        tensor.device != device
        or str(tensor.dtype).removeprefix("torch.") != spec.dtype
        or not tensor.is_contiguous()
        or spec.nbytes != nbytes
    ):
        return None
    return tensor.reshape(-1).view(torch.uint8)
