"""Bounded staleness by admission control: a group starts only on recent enough weights.

Two rules (async-rl.md, AReaL's admission control); a prompt record may start when both hold:
  1. served_version >= record.min_version. The learner's feeder sets min_version from the prompt's
     queue position and K (learner/feeder.py), so no group is trained more than K versions after the
     version it was sampled with. K = 0 gives synchronous, on-policy training.
  2. (optional, `max_staleness` >= 0, training prompts only) learner_version - served_version <= K:
     a generator whose weights fell behind the learner (a slow or failed sync) stops starting
     groups until it catches up.
Nothing is dropped: a refused record stays with its generator (unacked) until admitted.

`wait` blocks on one record, calling `while_waiting` (the worker applies received weights there)
every `poll_s`, and accumulates the blocked time. A dead learner never wedges a generator: it
keeps serving its last version, and only records that need a newer one wait; `stop` ends a wait.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from broker import codec
from broker.schemas import PromptRecord, WeightVersion
from broker.transport import Transport, TransportError

log = logging.getLogger(__name__)


class StalenessGate:
    """Decides whether a prompt record may start now, and waits until it may."""

    def __init__(
        self,
        *,
        served: Callable[[], int],
        learner: Callable[[], int | None] = lambda: None,
        max_staleness: int = -1,
        poll_s: float = 0.5,
        on_blocked: Callable[[float], None] = lambda seconds: None,
    ):
        self.served = served
        self.learner = learner
        self.max_staleness = max_staleness
        self.poll_s = poll_s
        self.on_blocked = on_blocked
        self.blocked_s = 0.0
        """Total seconds spent waiting in `wait`."""

    def refusal(self, record: PromptRecord) -> str | None:
        """Why `record` may not start now ("min_version" or "max_staleness"), or None."""
        served = self.served()
        if served < record.min_version:
            return "min_version"
        if self.max_staleness >= 0 and record.split == "train":
            learner = self.learner()
            if learner is not None and learner - served > self.max_staleness:
                return "max_staleness"
        return None

    def split(self, records: Sequence) -> tuple[list, list]:
        """(admitted, held) items of `records`, each a PromptRecord or a (delivery, PromptRecord) pair."""
        admitted, held = [], []
        for item in records:
            record = item[1] if isinstance(item, tuple) else item
            (held if self.refusal(record) else admitted).append(item)
        return admitted, held

    def wait(
        self,
        record: PromptRecord,
        *,
        while_waiting: Callable[[], None] = lambda: None,
        stop: threading.Event | None = None,
        timeout_s: float | None = None,
    ) -> bool:
        """Block until `record` may start (True), or `stop` is set / `timeout_s` passed (False)."""
        stop = stop or threading.Event()
        start = last = time.monotonic()
        reason = self.refusal(record)
        if reason is not None:
            log.info(
                "staleness gate: holding %s (%s; min_version %d, serving %d)",
                record.prompt_id,
                reason,
                record.min_version,
                self.served(),
            )
        try:
            while reason is not None:
                if stop.is_set() or (timeout_s is not None and time.monotonic() - start >= timeout_s):
                    return False
                while_waiting()
                stop.wait(self.poll_s)
                now = time.monotonic()
                self._count(now - last)
                last = now
                reason = self.refusal(record)
            return True
        finally:
            self._count(time.monotonic() - last)

    def _count(self, seconds: float) -> None:
        if seconds > 0:
            self.blocked_s += seconds
            self.on_blocked(seconds)


class VersionReader:
    """The learner's latest announced version (a WeightVersion value on the broker), cached for `ttl_s`.

    Unset, unreadable or malformed values read as None (no learner known): the gate then applies
    only the min_version rule.
    """

    def __init__(self, transport: Transport, key: str, ttl_s: float = 0.5):
        self.transport = transport
        self.key = key
        self.ttl_s = ttl_s
        self._value: int | None = None
        self._read_at = float("-inf")

    def __call__(self) -> int | None:
        now = time.monotonic()
        if now - self._read_at >= self.ttl_s:
            self._value = self._read()
            self._read_at = now
        return self._value

    def _read(self) -> int | None:
        try:
            data = self.transport.get_value(self.key)
        except TransportError as exc:
            log.warning("cannot read %s: %s", self.key, exc)
            return self._value
        if data is None:
            return None
        try:
            msg = codec.decode(data)
        except codec.MessageError as exc:
            log.warning("malformed version value at %s: %s", self.key, exc)
            return None
        return msg.version if isinstance(msg, WeightVersion) else None
