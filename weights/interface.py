"""The two interfaces of weight sync, `WeightSender` and `WeightReceiver`, and what they hand over.

Every transport implements both (weights/broadcast_*.py, weights/ipc_*.py); `weights.sender(cfg)` and
`weights.receiver(cfg, ...)` pick one by the configured transport. The contract:

  sender.start()                      -> Announcement (also published through `publish`)
  sender.sync(model, version, step)   -> SyncReport, once every live generator can read the version
  sender.members()                    -> {generator id: version it serves}
  receiver.start()                    joins in the background (and rejoins after any failure)
  receiver.poll()                     -> the newest whole, verified version not handed out yet, or None
  receiver.mark_served(version)       after every version poll() returned: what the engine serves now
                                      (its new version, or its old one if it refused it); releases it
  receiver.close()

With an `apply(named_tensors, version)` callback the receiver runs that loop itself on a thread.
A version is delivered whole or not at all: nothing partial ever reaches the engine.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from weights.config import WeightReceiverConfig, WeightSenderConfig
from weights.manifest import views
from weights.membership import Member, Membership, Publish
from weights.protocol import Announcement, Manifest
from weights.vllm_layout import checkpoint_views

log = logging.getLogger(__name__)

ApplyFn = Callable[[Iterable[tuple[str, torch.Tensor]], int], None]
Resolve = Callable[[], Announcement | None]


class ReceivedVersion:
    """One whole, verified policy version: its manifest and where its bytes are.

    `named_tensors()` yields (name, tensor) views of the received buffers; they stay valid until
    `mark_served` is called for this version. `ipc` is set for a cuda-ipc version: the reference to
    the learner's buffer (plain data), which an engine whose model lives in another process maps there
    instead of here (weights/vllm_apply.py). `from_pairs` wraps tensors from elsewhere (a file, a test)."""

    def __init__(
        self,
        manifest: Manifest | None,
        buffers: list[torch.Tensor] | Callable[[], list[torch.Tensor]] = (),
        *,
        seconds: float = 0.0,
        ipc=None,
        pairs: list[tuple[str, torch.Tensor]] | None = None,
        version: int | None = None,
    ):
        self.manifest = manifest
        self._buffers = buffers
        self.seconds = seconds
        """From the start of the transfer (or the lock) to verification."""
        self.ipc = ipc
        self._pairs = pairs
        self.version = manifest.version if version is None else version

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, torch.Tensor]], version: int) -> ReceivedVersion:
        return cls(None, pairs=list(pairs), version=version)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The bucket buffers (a cuda-ipc version maps the learner's buffer here on first use)."""
        if callable(self._buffers):
            self._buffers = self._buffers()
        return list(self._buffers)

    @property
    def num_bytes(self) -> int:
        if self.manifest is not None:
            return self.manifest.total_bytes
        return sum(t.numel() * t.element_size() for _, t in self._pairs)

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, view) of every tensor, whatever the wire layout."""
        if self._pairs is not None:
            return iter(self._pairs)
        return checkpoint_views(self.manifest, views(self.manifest, self.buffers))


@dataclass
class SyncReport:
    """What one `sync` did (on training ranks other than 0 only version/step/seconds are meaningful)."""

    version: int
    step: int
    num_bytes: int
    seconds: float
    sent_to: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    pack_seconds: float = 0.0
    """Packing (and sending) the version, after any wait for the receivers."""
    wait_seconds: float = 0.0
    """cuda-ipc: waiting for generators to let go of the buffer."""


@dataclass
class ReceiverStats:
    """Counters of a receiver."""

    versions: int = 0
    """Versions handed out by poll()."""
    bytes: int = 0
    last_seconds: float = 0.0
    failures: int = 0
    """Transfers that failed or did not verify, or a learner that went away (the engine kept its weights)."""
    apply_failures: int = 0
    joins: int = 0
    refused: int = 0
    """Join requests the learner refused (wrong token or transport)."""
    last_error: str = ""
    history: list[int] = field(default_factory=list)
    """Versions handed out, in order (last 100)."""


class WeightSender(abc.ABC):
    """Learner side; every training rank calls `sync` (collectively, for an FSDP2 model). The rendezvous
    and the members are shared (weights/membership.py); a transport implements `sync`, `_admit` (build
    a joiner's session and answer it) and `_end` (tear a dropped member's session down)."""

    transport: str

    def __init__(self, config: WeightSenderConfig, *, publish: Publish | None = None, rank: int = 0):
        self.config = config
        self._rank = rank
        self._membership = Membership(
            config, self.transport, admit=self._admit, end=self._end, publish=publish
        )

    def start(self) -> Announcement | None:
        """Rank 0: bind the rendezvous, start admitting generators, publish and return the announcement."""
        return self._membership.start() if self._rank == 0 else None

    @property
    def announcement(self) -> Announcement:
        return self._membership.rendezvous.announcement

    def members(self) -> dict[str, int]:
        """Connected generators -> the version each serves (-1 before its first)."""
        return self._membership.members()

    def close(self) -> None:
        """End every session and release the rendezvous; idempotent."""
        self._membership.close()
        self._release()

    def begin_write(self) -> float:
        """Called before the optimizer writes the parameters; returns the seconds it waited. A transport
        whose generators read the parameters themselves (cuda-ipc with `params_in_buffer`) locks them out
        here until the next `sync`; the others have nothing to do."""
        return 0.0

    @abc.abstractmethod
    def sync(self, model: torch.nn.Module, version: int, step: int = 0) -> SyncReport:
        """Make the model's current weights version `version` for every connected generator."""

    @abc.abstractmethod
    def _admit(self, store, ticket: int, request) -> None: ...

    @abc.abstractmethod
    def _end(self, member: Member, reason: str) -> None: ...

    @abc.abstractmethod
    def _release(self) -> None:
        """Drop what the transport holds (after every session ended)."""


class WeightReceiver(abc.ABC):
    """Generator side (module docstring); a transport implements `_start`, `_poll`, `_release`, `_close`."""

    transport: str

    def __init__(
        self,
        config: WeightReceiverConfig,
        generator_id: str,
        *,
        resolve: Resolve | None = None,
        apply: ApplyFn | None = None,
        version: int = -1,
    ):
        """`version`: what the engine serves now (-1 unknown); the learner skips re-sending it.
        `resolve`: reads the learner's announcement (used when `config.address` is "")."""
        if not config.address and resolve is None:
            raise ValueError("weight_sync.address is empty and no resolve callback was given")
        self.config = config
        self.generator_id = generator_id
        self._stats = ReceiverStats()
        self._resolve = resolve
        self._apply = apply
        self._served = version
        self._stop = threading.Event()
        self._applier: threading.Thread | None = None

    @property
    def stats(self) -> ReceiverStats:
        return self._stats

    @property
    def version(self) -> int:
        """The version the engine serves (the last `mark_served`)."""
        return self._served

    def start(self) -> WeightReceiver:
        self._start()
        if self._apply is not None and self._applier is None:
            name = f"weight-apply-{self.generator_id}"
            self._applier = threading.Thread(target=self._apply_loop, name=name, daemon=True)
            self._applier.start()
        return self

    def poll(self) -> ReceivedVersion | None:
        """The newest verified version newer than the one served, or None; call `mark_served` after it."""
        received = self._poll()
        if received is not None:
            self.stats.versions += 1
            self.stats.bytes += received.num_bytes
            self.stats.last_seconds = received.seconds
            self.stats.history = [*self.stats.history[-99:], received.version]
        return received

    def mark_served(self, version: int) -> None:
        """The engine serves `version` now (the new one, or its old one when it refused the new)."""
        self._served = version
        self._release(version)

    def wait_for(self, version: int, timeout_s: float) -> bool:
        """Block until the served version is >= `version` (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self._served < version:
            if time.monotonic() > deadline:
                return False
            time.sleep(self.config.poll_s)
        return True

    def close(self) -> None:
        self._stop.set()
        if self._applier is not None:
            self._applier.join(timeout=self.config.timeout_s + 5)
            self._applier = None
        self._close()

    def target(self) -> Announcement | None:
        """Where to join: the configured address, else the learner's announcement of this transport."""
        if self.config.address:
            return Announcement(
                transport=self.transport, address=self.config.address, token=self.config.token
            )
        announced = self._resolve() if self._resolve is not None else None
        if announced is None or announced.transport != self.transport:
            return None
        return announced

    def _apply_loop(self) -> None:
        while not self._stop.is_set():
            try:
                received = self.poll()
            except Exception as e:
                self.stats.failures += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"
                received = None
            if received is None:
                self._stop.wait(self.config.poll_s)
                continue
            served = self._served
            try:
                self._apply(received.named_tensors(), received.version)
                served = received.version
            except Exception as e:
                self.stats.apply_failures += 1
                self.stats.last_error = f"apply failed: {type(e).__name__}: {e}"
                log.error(
                    "weight receiver %s: apply of version %d failed: %s",
                    self.generator_id,
                    received.version,
                    e,
                )
            finally:
                self.mark_served(served)

    @abc.abstractmethod
    def _start(self) -> None:
        """Start joining in the background."""

    @abc.abstractmethod
    def _poll(self) -> ReceivedVersion | None: ...

    @abc.abstractmethod
    def _release(self, version: int) -> None:
        """Let go of the version last handed out; report `version` as served to the learner."""

    @abc.abstractmethod
    def _close(self) -> None: ...
