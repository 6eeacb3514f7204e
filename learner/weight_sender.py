"""Learner side of weight sync: push each new policy version to every generator, in large buckets.

The learner hosts a TCPStore rendezvous (the control channel) and is rank 0 of one 2-rank
process group per connected generator (gloo on CPU, NCCL between GPUs), separate from any
training group. Per sync: a `Manifest` per generator through the store, then the packed buckets
and a checksum trailer as broadcasts on every generator's group at once (the protocol is in
`policy/weight_transfer.py`).

Membership is dynamic: a background thread admits joining generators at any time (and, with
`keep_last`, immediately sends them the last synced version from a packed host copy, so a
restarted generator never waits for the next optimizer step). A generator that fails or misses
`timeout_s` on any bucket is dropped; the sync carries on with the rest and never waits longer
than `timeout_s` for a dead one.

Use (every training rank calls `sync`, collectively; rank 0 does the sending):

    sender = WeightSender(SenderConfig(host="10.0.0.5"), publish=broker_publisher(transport, names))
    sender.start()                       # binds the rendezvous, publishes "host:port"
    ...after each optimizer step:
    report = sender.sync(model, version=step, step=step)
    sender.close()

Pass the Hugging Face model itself (e.g. `PackedPolicy.model`): names on the wire are the
checkpoint names `save_pretrained` writes. With an FSDP2 model the full tensors are gathered
(`DTensor.full_tensor()`) one bucket at a time, so the extra memory is two buckets (plus the
`keep_last` copy on rank 0). Without `keep_last`, a bucket holding one big tensor is sent from
the tensor's own memory (no packing copy).

A generator on the learner's own GPU cannot pair with it over NCCL; it is served over gloo
through host memory (correct, slow); policy/weight_ipc.py is the CUDA IPC path for that case.
"""

from __future__ import annotations

import collections
import datetime
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from policy.weight_transfer import (
    DEFAULT_BUCKET_BYTES,
    JoinAccept,
    JoinRequest,
    Keys,
    Layout,
    Manifest,
    checkpoint_names,
    checksum,
    decode,
    device_uuid,
    dtype_from_name,
    encode,
    named_tensors,
    pack_bucket,
    pair_group,
    plan_layout,
    wait_work,
)

log = logging.getLogger(__name__)


@dataclass
class SenderConfig:
    """Weight-sync settings of the learner."""

    host: str = "127.0.0.1"
    """Address generators reach the rendezvous at (published as "host:port"); gloo binds to it too."""
    port: int = 0
    """TCP port of the rendezvous store; 0 picks a free one."""
    backend: str = "gloo"
    """"gloo" (CPU buffers) or "nccl" (GPU buffers; generators on other GPUs)."""
    bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20
    """Size of one packed bucket in MiB; each bucket is one collective per generator."""
    timeout_s: float = 60.0
    """Bound on every rendezvous and every bucket transfer; a generator that misses it is dropped."""
    send_dtype: str = ""
    """Cast floating-point tensors to this dtype before sending (e.g. "bfloat16"); "" keeps each dtype."""
    checksums: bool = True
    """Send a checksum per bucket in the trailer; receivers reject a version that does not match."""
    keep_last: bool = True
    """Keep the last version packed in memory so that a joining generator gets it at once."""
    poll_s: float = 0.02
    """How often the admission thread looks for join requests."""
    rank: int | None = None
    """This process's training rank (None: the default process group's rank, or 0)."""


@dataclass
class SyncReport:
    """What one `sync` did (on ranks other than 0 only version/step/seconds are meaningful)."""

    version: int
    step: int
    num_bytes: int
    seconds: float
    sent_to: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)


@dataclass(eq=False)
class _Member:
    generator_id: str
    session: int
    group: object
    backend: str
    transfers: int = 0
    alive: bool = True


@dataclass
class _Cache:
    manifest: Manifest
    buffers: list[torch.Tensor]
    checksums: list[int]


def broker_publisher(transport, names) -> Callable[[str], None]:
    """A `publish` callback that stores the address under `names.weight_sync_address` on the broker."""
    return lambda address: transport.set_value(names.weight_sync_address, address.encode())


class WeightSender:
    """Rank 0 hosts the rendezvous and sends; other training ranks only join the FSDP gathers."""

    def __init__(self, config: SenderConfig, *, publish: Callable[[str], None] | None = None):
        self.config = config
        self._publish = publish
        self._rank = config.rank if config.rank is not None else _default_rank()
        nccl = config.backend == "nccl"
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        self._uuid = device_uuid(self._device)
        self._store = None
        self._members: list[_Member] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._names: tuple[torch.nn.Module, dict[str, str]] | None = None
        self._cache: _Cache | None = None
        self._staging: list[torch.Tensor] = []
        """Bucket buffers reused across syncs (all buckets with keep_last, else two that alternate)."""

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str | None:
        """Rank 0: bind the rendezvous store, start admitting generators, publish and return "host:port"."""
        if self._rank != 0:
            return None
        from torch.distributed import TCPStore

        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        self._store = TCPStore(
            self.config.host, self.config.port, None, True, timeout, wait_for_workers=False
        )
        self._thread = threading.Thread(target=self._admit_loop, name="weight-sender-admit", daemon=True)
        self._thread.start()
        if self._publish is not None:
            self._publish(self.address)
        log.info("weight sync rendezvous at %s (%s)", self.address, self.config.backend)
        return self.address

    @property
    def address(self) -> str:
        if self._store is None:
            raise RuntimeError("WeightSender.start() was not called on rank 0")
        return f"{self.config.host}:{self._store.port}"

    def members(self) -> dict[str, int]:
        """Connected generators -> the last version each confirmed (-1 before its first)."""
        with self._lock:
            members = list(self._members)
        return {m.generator_id: _served(self._store, m.session) for m in members}

    def close(self) -> None:
        """Stop admitting, end every session and release the rendezvous; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.config.timeout_s)
            self._thread = None
        with self._lock:
            for m in list(self._members):
                self._drop(m, "learner closing", level=logging.INFO)
        self._store = None
        self._cache = None

    # ------------------------------------------------------------------ sync
    def sync(self, model: torch.nn.Module, version: int, step: int = 0) -> SyncReport:
        """Send the model's current weights as `version` to every connected generator.

        Collective over the training ranks when the model is FSDP-sharded. Returns after every
        live generator received the whole version (or was dropped), not after it applied it.
        """
        t0 = time.perf_counter()
        tensors = [t for _, t in named_tensors(model)]
        manifest = self._manifest(model, tensors, version, step)
        if self._rank != 0:
            for b in range(len(manifest.bucket_nbytes)):
                for i in self._layout.bucket_members(b):
                    _full(tensors[i])
            return SyncReport(version, step, 0, time.perf_counter() - t0)
        with self._lock:
            self._cache = None
            members = [m for m in self._members if m.alive]
            buffers: list[torch.Tensor] = []

            def produce(b: int) -> tuple[torch.Tensor, int]:
                idx = self._layout.bucket_members(b)
                specs, full = [manifest.tensors[i] for i in idx], [_full(tensors[i]) for i in idx]
                nbytes = manifest.bucket_nbytes[b]
                buf = None if self.config.keep_last else _unpacked(full, specs, nbytes, self._device)
                if buf is None:
                    buf = self._bucket_buffer(b, nbytes)
                    pack_bucket(buf, specs, full)
                    buffers.append(buf)
                return buf, checksum(buf) if self.config.checksums else 0

            sums = self._stream(members, manifest, produce)
            if self.config.keep_last:
                self._cache = _Cache(manifest, buffers, sums)
        sent = [m.generator_id for m in members if m.alive]
        dropped = [m.generator_id for m in members if not m.alive]
        return SyncReport(version, step, manifest.total_bytes, time.perf_counter() - t0, sent, dropped)

    def _manifest(self, model, tensors: list[torch.Tensor], version: int, step: int) -> Manifest:
        if self._names is None or self._names[0] is not model:
            self._names = (model, checkpoint_names(model))
        cast = dtype_from_name(self.config.send_dtype) if self.config.send_dtype else None
        names = self._names[1]
        entries = [
            (names[n], cast if cast is not None and t.is_floating_point() else t.dtype, tuple(t.shape))
            for (n, _), t in zip(named_tensors(model), tensors)
        ]
        self._layout: Layout = plan_layout(entries, int(self.config.bucket_mb * 2**20))
        return Manifest(
            version=version,
            step=step,
            tensors=self._layout.tensors,
            bucket_nbytes=self._layout.bucket_nbytes,
            checksums=self.config.checksums,
        )

    def _bucket_buffer(self, b: int, nbytes: int) -> torch.Tensor:
        """One buffer per bucket when the version is kept, else one of two alternating staging buffers;
        both are reused from sync to sync (fresh host memory costs page faults that outweigh the copy)."""
        slot = b if self.config.keep_last else b % 2
        while len(self._staging) <= slot:
            self._staging.append(torch.empty(0, dtype=torch.uint8, device=self._device))
        if self._staging[slot].numel() < nbytes:
            self._staging[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        return self._staging[slot][:nbytes]

    def _stream(self, members: list[_Member], manifest: Manifest, produce) -> list[int]:
        """Announce `manifest`, then send every bucket (two in flight) and the trailer; returns the checksums.

        `produce(b)` packs bucket b; it is called only after the bucket two before it is done,
        so two staging buffers can alternate. Failing members are dropped along the way.
        """
        for m in members:
            self._announce(m, manifest)
        inflight: collections.deque = collections.deque()
        sums = []
        for b in range(len(manifest.bucket_nbytes)):
            if len(inflight) == 2:
                self._settle(inflight.popleft()[1])
            buf, total = produce(b)
            sums.append(total)
            inflight.append((buf, self._launch(members, buf)))  # buf stays referenced until settled
        while inflight:
            self._settle(inflight.popleft()[1])
        tail = torch.tensor([manifest.version, *sums], dtype=torch.int64, device=self._device)
        self._settle(self._launch(members, tail))
        return sums

    def _announce(self, member: _Member, manifest: Manifest) -> None:
        try:
            self._store.set(Keys.manifest(member.session, member.transfers), encode(manifest))
            member.transfers += 1
        except Exception as e:  # the store is ours; this only fails when we are shutting down
            self._drop(member, f"manifest not written: {e}")

    def _launch(self, members: list[_Member], buf: torch.Tensor) -> list:
        works = []
        for m in members:
            if not m.alive:
                continue
            try:
                works.append((m, m.group.broadcast(buf, 0)))
            except Exception as e:
                self._drop(m, f"send failed: {e}")
        return works

    def _settle(self, works: list) -> None:
        for m, work in works:
            if not m.alive:
                continue
            try:
                wait_work(work, m.backend, self.config.timeout_s)
            except Exception as e:
                self._drop(m, f"transfer failed: {e}")

    def _drop(self, member: _Member, reason: str, level: int = logging.WARNING) -> None:
        """Forget a generator (it rejoins by itself); the caller holds the lock."""
        if not member.alive:
            return
        member.alive = False
        log.log(
            level,
            "weight sync: dropping generator %s (session %d): %s",
            member.generator_id,
            member.session,
            reason,
        )
        if member in self._members:
            self._members.remove(member)
        try:  # wakes a receiver waiting for its next manifest; one mid-transfer fails on the aborted group
            if self._store is not None:
                key = Keys.manifest(member.session, member.transfers)
                self._store.set(key, Keys.ENDED + reason[:200].encode())
        except Exception:
            pass
        _abort(member.group)

    # ------------------------------------------------------------------ admission
    def _admit_loop(self) -> None:
        store = self._store.clone()
        next_ticket = 1
        while not self._stop.is_set():
            try:
                seq = store.add(Keys.JOIN_SEQ, 0)
            except Exception as e:
                log.warning("weight sync: rendezvous store failed (%s); admission stops", e)
                return
            while next_ticket <= seq and not self._stop.is_set():
                self._admit(store, next_ticket)
                next_ticket += 1
            self._stop.wait(self.config.poll_s)

    def _admit(self, store, ticket: int) -> None:
        """Accept one join request: build its group, send the kept version if it lacks it, add it."""
        try:
            request = decode(store.get(Keys.join(ticket)), JoinRequest)
        except Exception as e:
            log.warning("weight sync: join request %d rejected: %s", ticket, e)
            return
        backend = self._backend_for(request)
        accept = JoinAccept(session=ticket, backend=backend, timeout_s=self.config.timeout_s)
        try:
            store.set(Keys.accept(ticket), encode(accept))
            group = pair_group(backend, store, ticket, 0, self.config.timeout_s, self.config.host)
        except Exception as e:
            log.warning("weight sync: generator %s did not complete its join: %s", request.generator_id, e)
            return
        member = _Member(request.generator_id, ticket, group, backend)
        with self._lock:
            for old in [m for m in self._members if m.generator_id == request.generator_id]:
                self._drop(old, "replaced by a new session of the same generator")
            cache = self._cache
            if cache is not None and cache.manifest.version != request.version:
                self._stream([member], cache.manifest, lambda b: (cache.buffers[b], cache.checksums[b]))
            if member.alive:
                self._members.append(member)
                log.info("weight sync: generator %s joined (session %d)", request.generator_id, ticket)

    def _backend_for(self, request: JoinRequest) -> str:
        """The configured backend, except gloo for a generator on this learner's own GPU: NCCL cannot
        pair two ranks on one device, and gloo stages the CUDA buffers through host memory (correct
        but slow; policy/weight_ipc.py is the fast path for a shared GPU)."""
        if self.config.backend == "nccl" and request.device_uuid and request.device_uuid == self._uuid:
            log.warning(
                "weight sync: generator %s shares this learner's GPU; NCCL cannot pair them, sending "
                "through gloo (use policy/weight_ipc.py on a shared GPU)",
                request.generator_id,
            )
            return "gloo"
        return self.config.backend


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered when it is an FSDP2 DTensor (collective), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _unpacked(
    full: list[torch.Tensor], specs: list, nbytes: int, device: torch.device
) -> torch.Tensor | None:
    """A bucket that holds one big tensor goes out as that tensor's own bytes (no packing copy) when
    nothing needs converting: same device and dtype, contiguous, and a size that needs no padding."""
    if len(full) != 1:
        return None
    tensor, spec = full[0].detach(), specs[0]
    if (
        tensor.device != device
        or str(tensor.dtype).removeprefix("torch.") != spec.dtype
        or not tensor.is_contiguous()
        or spec.nbytes != nbytes
    ):
        return None
    return tensor.reshape(-1).view(torch.uint8)


def _default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _served(store, session: int) -> int:
    try:
        return int(store.get(Keys.served(session))) if store.check([Keys.served(session)]) else -1
    except Exception:
        return -1


def _abort(group) -> None:
    try:
        group.abort()
    except Exception:
        pass
