"""The learner's announcement on the broker, and a receiver that follows whichever transport it names.

The learner publishes an `Announcement` (transport, rendezvous "host:port", the run's token) under
`names.weight_sync_address` (`broker_publisher`); generators read it (`broker_resolver`). With
`WeightReceiverConfig.address = ""` a generator's receiver is a `FollowingReceiver`: it builds the
receiver of the announced transport when the learner first appears, and rebuilds it if a restarted
learner announces the other one, so generators need no setting that must match the learner's.
The announcement is sealed with the run's message key (broker/auth.py, when the transport has one):
an announcement someone else wrote to the broker, pointing generators at another rendezvous, is
refused and logged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from broker.auth import AuthError, key_of, open_sealed, seal
from weights.interface import ReceivedVersion, ReceiverStats, Resolve, WeightReceiver
from weights.protocol import Announcement, WeightSyncError, decode, encode

log = logging.getLogger(__name__)

Make = Callable[[str, Resolve, int], WeightReceiver]
"""(transport, resolve, version) -> a started receiver of that transport."""


def broker_publisher(transport, names) -> Callable[[Announcement], None]:
    """A `publish` callback storing the announcement (msgpack) under `names.weight_sync_address`."""

    def publish(announcement: Announcement) -> None:
        name = names.weight_sync_address
        transport.set_value(name, seal(key_of(transport), name, encode(announcement)))

    return publish


def broker_resolver(transport, names) -> Resolve:
    """A `resolve` callback reading the learner's announcement from the broker (None: none, withdrawn by a
    learner that closed, or malformed)."""

    def resolve() -> Announcement | None:
        value = transport.get_value(names.weight_sync_address)
        if not value:
            return None
        try:
            body = open_sealed(key_of(transport), names.weight_sync_address, value)
            announced = decode(body, Announcement)
        except (WeightSyncError, AuthError) as exc:
            log.error("the learner's weight-sync announcement is refused: %s", exc)
            return None
        return announced if announced.address else None

    return resolve


class FollowingReceiver(WeightReceiver):
    """A receiver of the transport the learner announces, built on first sight and rebuilt on change."""

    transport = "follow"

    def __init__(self, config, generator_id, *, resolve: Resolve, make: Make, version: int = -1, **kwargs):
        super().__init__(config, generator_id, resolve=resolve, version=version, **kwargs)
        self._make = make
        self._inner: WeightReceiver | None = None

    @property
    def kind(self) -> str | None:
        """The transport followed now ("broadcast" or "cuda-ipc"), None before the learner appeared."""
        return self._inner.transport if self._inner is not None else None

    @property
    def stats(self) -> ReceiverStats:
        return self._inner.stats if self._inner is not None else self._stats

    def poll(self) -> ReceivedVersion | None:
        self._follow()
        return self._inner.poll() if self._inner is not None else None

    def mark_served(self, version: int) -> None:
        self._served = version
        if self._inner is not None:
            self._inner.mark_served(version)

    def _start(self) -> None:
        self._follow()

    def _poll(self) -> ReceivedVersion | None:  # poll() is overridden: the inner receiver counts
        return None

    def _release(self, version: int) -> None:
        pass

    def _close(self) -> None:
        if self._inner is not None:
            self._inner.close()
            self._inner = None

    def _follow(self) -> None:
        try:
            announced = self._resolve()
        except Exception as exc:  # a broker hiccup: keep the current receiver
            log.warning("weight-sync announcement unreadable (%s: %s)", type(exc).__name__, exc)
            return
        if announced is None or announced.transport == self.kind:
            return
        if self._inner is not None:
            log.info("the learner switched weight sync from %s to %s", self.kind, announced.transport)
            self._inner.close()
            self._inner = None
        try:
            self._inner = self._make(announced.transport, self._only(announced.transport), self._served)
        except ValueError as exc:
            log.error("cannot follow the learner's weight sync: %s", exc)

    def _only(self, transport: str) -> Resolve:
        """The inner receiver's resolver: the announcement while it names `transport`, else None."""

        def resolve() -> Announcement | None:
            announced = self._resolve()
            return announced if announced is not None and announced.transport == transport else None

        return resolve
