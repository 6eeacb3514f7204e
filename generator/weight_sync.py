"""Pick the generator's weight receiver from the address the learner publishes.

The learner publishes its weight-sync rendezvous on the broker (`names.weight_sync_address`):
  * "host:port"            the bucketed broadcast (learner/weight_sender.py: NCCL on GPU, gloo on CPU),
                           received by generator/weight_receiver.WeightReceiver;
  * "cuda-ipc://host:port" CUDA IPC (policy/weight_ipc.py: the learner shares one packed buffer and the
                           generator's engine reads it in place; learner and generator on one host,
                           the learner on one rank), received by policy.weight_ipc.IpcWeightReceiver.

`start_receiver` returns a receiver with the mailbox interface the worker uses (`take()`,
`mark_served(version)`, `close()`, `stats`). With an explicit address the kind is fixed at once;
with the broker's address it is chosen when the learner first appears and re-chosen if a restarted
learner publishes the other kind, so generators need no setting that must match the learner's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

IPC_SCHEME = "cuda-ipc://"


def ipc_address(host_port: str) -> str:
    """The published form of a CUDA-IPC rendezvous."""
    return IPC_SCHEME + host_port


def split_address(address: str) -> tuple[str, str]:
    """("ipc" | "broadcast", "host:port") of a published address."""
    if address.startswith(IPC_SCHEME):
        return "ipc", address[len(IPC_SCHEME) :]
    if "://" in address:
        raise ValueError(
            f"unknown weight-sync address scheme in {address!r} (expected host:port or {IPC_SCHEME}host:port)"
        )
    return "broadcast", address


def start_receiver(
    generator_id: str,
    address: str,
    resolve: Callable[[], str | None] | None,
    *,
    device: str,
    version: int,
    timeout_s: float,
):
    """The started receiver for `address` ("" = follow `resolve`), or None for "none"."""
    if address == "none":
        return None
    make = _factory(generator_id, device=device, timeout_s=timeout_s)
    if address:
        kind, host_port = split_address(address)
        return make(kind, host_port, None, version)
    if resolve is None:
        raise ValueError("no weight-sync address and no resolver")
    return FollowingReceiver(resolve, make, version)


def _factory(generator_id: str, *, device: str, timeout_s: float):
    def make(kind: str, host_port: str, resolve, version: int):
        if kind == "ipc":
            from policy.weight_ipc import IpcWeightReceiver

            return IpcWeightReceiver(generator_id, host_port, resolve=resolve, version=version)
        from generator.weight_receiver import ReceiverConfig, WeightReceiver

        config = ReceiverConfig(
            generator_id=generator_id, address=host_port, device=device, timeout_s=timeout_s
        )
        return WeightReceiver(config, resolve=resolve, version=version).start()

    return make


class FollowingReceiver:
    """Builds the receiver that matches the learner's published address, on first sight and on change."""

    def __init__(self, resolve: Callable[[], str | None], make, version: int):
        self._resolve = resolve
        self._make = make
        self._kind: str | None = None
        self._inner = None
        self._served = version

    @property
    def kind(self) -> str | None:
        """ "ipc" or "broadcast" once the learner was seen, else None."""
        return self._kind

    @property
    def stats(self):
        return getattr(self._inner, "stats", None)

    def take(self):
        """The newest version from the current receiver (None while no learner has published)."""
        self._follow()
        return self._inner.take() if self._inner is not None else None

    def mark_served(self, version: int) -> None:
        self._served = version
        if self._inner is not None:
            self._inner.mark_served(version)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
            self._inner = None

    def _follow(self) -> None:
        try:
            published = self._resolve()
        except Exception as exc:  # a broker hiccup: keep the current receiver
            log.warning("weight-sync address unreadable (%s: %s)", type(exc).__name__, exc)
            return
        if not published:
            return
        try:
            kind, _ = split_address(published)
        except ValueError as exc:
            log.error("%s", exc)
            return
        if kind == self._kind:
            return
        if self._inner is not None:
            log.info("learner switched weight sync from %s to %s", self._kind, kind)
            self._inner.close()
        self._kind = kind
        self._inner = self._make(kind, "", self._strip(kind), self._served)

    def _strip(self, kind: str) -> Callable[[], str | None]:
        """A resolver for the inner receiver: the host:port of the learner while it publishes this kind."""

        def resolve() -> str | None:
            published = self._resolve()
            try:
                got, host_port = split_address(published or "")
            except ValueError:
                return None
            return host_port if published and got == kind else None

        return resolve
