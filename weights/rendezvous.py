"""The rendezvous both transports meet at: a TCPStore the learner hosts, admission with the run's token.

Learner side (`Rendezvous`): binds a TCPStore server to `WeightSenderConfig.host` (the address it
announces; loopback by default), draws the run's token unless one is configured, and runs one
admission thread: every `JoinRequest` that presents the token and names this transport is handed to
the sender's `admit` callback (which builds the session and writes the `JoinAccept`); any other
request is answered with a refusal and never becomes a member.

Generator side: `connect` reaches the store, `join` takes a ticket and waits for the answer
(`JoinRefused` when refused). Also here: `pair_group`, a 2-rank process group (learner rank 0, one
generator rank 1) on the shared store without `init_process_group`, and `wait_work`.
"""

from __future__ import annotations

import datetime
import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable

import torch

from weights.protocol import (
    Announcement,
    JoinAccept,
    JoinRequest,
    Keys,
    WeightSyncError,
    decode,
    encode,
)

log = logging.getLogger(__name__)

ADMIT_POLL_S = 0.02
"""How often the admission thread looks for new join requests."""


class JoinRefused(WeightSyncError):
    """The learner refused this generator's join request (wrong token or transport)."""


def bound_store(host: str, port: int, timeout_s: float):
    """A TCPStore server listening on `host` only (TCPStore alone would listen on every interface)."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise WeightSyncError(f"weight-sync rendezvous cannot listen on {host}:{port}: {e}") from e
    timeout = datetime.timedelta(seconds=timeout_s)
    bound = sock.getsockname()[1]
    return TCPStore(host, bound, None, True, timeout, wait_for_workers=False, master_listen_fd=sock.detach())


def connect(address: str, connect_timeout_s: float, timeout_s: float):
    """A client of the store at "host:port" (raises if nobody answers within `connect_timeout_s`)."""
    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    connect_timeout = datetime.timedelta(seconds=connect_timeout_s)
    store = TCPStore(host, int(port), None, False, connect_timeout, wait_for_workers=False)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def join(store, request: JoinRequest) -> JoinAccept:
    """Take a ticket, post `request`, wait for the learner's answer (the store's timeout bounds the wait)."""
    ticket = store.add(Keys.JOIN_SEQ, 1)
    store.set(Keys.join(ticket), encode(request))
    accept = decode(store.get(Keys.accept(ticket)), JoinAccept)
    if accept.refused:
        raise JoinRefused(accept.refused)
    return accept


Admit = Callable[[object, int, JoinRequest], None]
"""The sender's part of admission: (store, ticket, request) -> build the session, write its JoinAccept."""


class Rendezvous:
    """The learner's store, token and admission thread (see the module docstring)."""

    def __init__(self, host: str, port: int, token: str, transport: str, timeout_s: float, admit: Admit):
        self.host, self.port, self.transport, self.timeout_s = host, port, transport, timeout_s
        self.token = token or secrets.token_urlsafe(24)
        self.refused = 0
        """Join requests refused so far (wrong token, other transport, malformed)."""
        self._admit = admit
        self.store = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Announcement:
        self.store = bound_store(self.host, self.port, self.timeout_s)
        self._thread = threading.Thread(target=self._loop, name="weight-sync-admit", daemon=True)
        self._thread.start()
        return self.announcement

    @property
    def announcement(self) -> Announcement:
        if self.store is None:
            raise RuntimeError("the weight sender was not started")
        return Announcement(
            transport=self.transport, address=f"{self.host}:{self.store.port}", token=self.token
        )

    def served(self, session: int) -> int:
        """The version the generator of `session` last reported serving (-1: none, or unreadable)."""
        try:
            store = self.store
            key = Keys.served(session)
            return int(store.get(key)) if store is not None and store.check([key]) else -1
        except Exception:
            return -1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout_s)
            self._thread = None

    def release(self) -> None:
        """Drop the store (the server stops listening once nothing else holds it)."""
        self.store = None

    def _loop(self) -> None:
        store = self.store.clone()
        next_ticket = 1
        while not self._stop.is_set():
            try:
                seq = store.add(Keys.JOIN_SEQ, 0)
            except Exception as e:
                log.warning("weight sync: rendezvous store failed (%s); admission stops", e)
                return
            while next_ticket <= seq and not self._stop.is_set():
                self._one(store, next_ticket)
                next_ticket += 1
            self._stop.wait(ADMIT_POLL_S)

    def _one(self, store, ticket: int) -> None:
        try:
            request = decode(store.get(Keys.join(ticket)), JoinRequest)
        except Exception as e:
            self._refuse(store, ticket, f"malformed join request: {e}")
            return
        if not hmac.compare_digest(request.token.encode(), self.token.encode()):
            self._refuse(store, ticket, f"generator {request.generator_id!r} did not present the run's token")
            return
        if request.transport != self.transport:
            self._refuse(store, ticket, f"the learner serves {self.transport}, not {request.transport}")
            return
        try:
            self._admit(store, ticket, request)
        except Exception as e:
            log.warning("weight sync: generator %s did not complete its join: %s", request.generator_id, e)

    def _refuse(self, store, ticket: int, reason: str) -> None:
        self.refused += 1
        log.warning("weight sync: join request %d refused: %s", ticket, reason)
        try:
            store.set(Keys.accept(ticket), encode(JoinAccept(session=ticket, refused=reason)))
        except Exception:
            pass


def device_uuid(device: torch.device | str) -> str:
    """The GPU's UUID for a CUDA device, "" otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def local_host_towards(host: str) -> str:
    """The local address that routes to `host` (what our side of a gloo pair binds to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def pair_group(backend: str, store, session: int, rank: int, timeout_s: float, host: str):
    """A 2-rank process group (0 = learner, 1 = generator) on `store`, without init_process_group.

    Construction is a rendezvous: it blocks until the other side constructs too (or `timeout_s`).
    """
    from torch.distributed import PrefixStore

    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = PrefixStore(Keys.group(session), store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        return ProcessGroupGloo(prefixed, rank, 2, opts)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        # wait_work() polls with `timeout_s` and aborts the group; NCCL's own watchdog (which would
        # tear the whole process down) gets a later deadline so that ours always fires first.
        opts._timeout = 2 * timeout + datetime.timedelta(seconds=30)
        return ProcessGroupNCCL(prefixed, rank, 2, opts)
    raise ValueError(f"unknown weight-sync backend {backend!r} (gloo or nccl)")


def wait_work(work, backend: str, timeout_s: float) -> None:
    """Wait for one collective; raise on error or after `timeout_s` (NCCL is polled with our deadline:
    its own watchdog would tear the process down; gloo enforces its group timeout itself)."""
    if backend != "nccl":
        work.wait()
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"collective did not finish within {timeout_s} s")
        time.sleep(0.0005)
    work.wait()


def abort(group) -> None:
    """Release a session's group (its sockets close, so the other side fails at once)."""
    try:
        if group is not None:
            group.abort()
    except Exception:
        pass
