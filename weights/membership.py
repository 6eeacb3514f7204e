"""The learner's list of connected generators, shared by both senders.

`Membership` owns the rendezvous (weights/rendezvous.py), publishes its announcement, keeps the
members (a rejoin under the same generator id replaces the old session), and drops a member with
one log line, calling the transport's `end(member, reason)` to tear its session down.

    membership = Membership(config, "broadcast", admit=..., end=..., publish=...)
    membership.start()                    # -> Announcement
    with membership.lock: live = membership.live()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from weights.config import WeightSenderConfig
from weights.protocol import Announcement
from weights.rendezvous import Admit, Rendezvous

log = logging.getLogger(__name__)

Publish = Callable[[Announcement], None]


@dataclass(eq=False)
class Member:
    """One admitted generator."""

    generator_id: str
    session: int
    group: object = None
    """broadcast: the 2-rank process group."""
    backend: str = ""
    transfers: int = 0
    """broadcast: manifests written to this session so far."""
    alive: bool = True


class Membership:
    """Members, their rendezvous and their removal (see the module docstring)."""

    def __init__(
        self,
        config: WeightSenderConfig,
        transport: str,
        *,
        admit: Admit,
        end: Callable[[Member, str], None],
        publish: Publish | None = None,
    ):
        self.rendezvous = Rendezvous(
            config.host, config.port, config.token, transport, config.timeout_s, admit
        )
        self.lock = threading.RLock()
        self._members: list[Member] = []
        self._end = end
        self._publish = publish

    def start(self) -> Announcement:
        announcement = self.rendezvous.start()
        if self._publish is not None:
            self._publish(announcement)
        log.info("weight sync (%s) rendezvous at %s", announcement.transport, announcement.address)
        return announcement

    @property
    def store(self):
        return self.rendezvous.store

    def live(self) -> list[Member]:
        """The members still alive (hold `lock` while using them)."""
        return [m for m in self._members if m.alive]

    def add(self, member: Member) -> None:
        """Admit `member`, replacing an older session of the same generator (caller holds `lock`)."""
        for old in [m for m in self._members if m.generator_id == member.generator_id]:
            self.drop(old, "replaced by a new session of the same generator")
        if member.alive:
            self._members.append(member)
            log.info("weight sync: generator %s joined (join %d)", member.generator_id, member.session)

    def drop(self, member: Member, reason: str, level: int = logging.WARNING) -> None:
        """Forget a generator (it rejoins by itself) and end its session; the caller holds `lock`."""
        if not member.alive:
            return
        member.alive = False
        log.log(
            level,
            "weight sync: dropping generator %s (join %d): %s",
            member.generator_id,
            member.session,
            reason,
        )
        if member in self._members:
            self._members.remove(member)
        try:
            self._end(member, reason)
        except Exception:
            pass

    def members(self) -> dict[str, int]:
        with self.lock:
            members = list(self._members)
        return {m.generator_id: self.rendezvous.served(m.session) for m in members}

    def close(self) -> None:
        """Stop admitting, end every session, withdraw the announcement, release the store."""
        self.rendezvous.close()
        with self.lock:
            for m in list(self._members):
                self.drop(m, "learner closing", level=logging.INFO)
        if self._publish is not None and self.store is not None:
            try:  # generators stop calling this rendezvous; the next learner's announcement replaces it
                self._publish(self.rendezvous.announcement.withdrawn())
            except Exception as exc:  # the broker may be gone first: generators then notice the store go
                log.debug("weight sync: announcement not withdrawn (%s: %s)", type(exc).__name__, exc)
        self.rendezvous.release()
