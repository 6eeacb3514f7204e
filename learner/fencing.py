"""One learner per run: a lock file in its run directory and a lease with an epoch on the broker.

    claim = claim_run(cfg)            # before the model loads; SystemExit naming the holder if another has it
    learner = Learner(cfg, fence=claim.lease.fence)
    ...
    claim.release()

`claim_run` first takes `RUN_DIR/learner.lock` (fcntl.flock, which the kernel drops when its process
dies): a second learner with the same run directory is refused at once. Then the broker lease
`names.learner_lease` (broker/lease.py), which covers learners on other hosts or with another run
directory sharing the run's broker namespace:
  * free (never taken, released, or expired after its holder stopped renewing it for LEASE_TTL_S):
    taken, with the next epoch;
  * held by a learner of this host that is gone (its run directory is this one, whose lock we now hold;
    or its pid no longer runs): taken over at once, with the next epoch (a learner restarted after a
    crash does not wait for the expiry);
  * held by another: it waits up to LEASE_TTL_S + 1 s for the lease to expire, then refuses to start,
    saying which learner holds the run (host, pid, run directory, since when, epoch).
While the learner runs, a thread renews the lease, and every publish, consume, ack, cursor write,
announcement and checkpoint of its transport is checked against its epoch on the broker
(`Transport.fence`): a learner whose lease another took writes nothing more and exits
(`lost_message`).
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from broker.lease import Lease
from broker.names import Names

log = logging.getLogger(__name__)

LEASE_TTL_S = 10.0
"""A learner that stopped renewing its lease this long loses it to the next one that starts."""
LOCK_FILE = "learner.lock"
HELD = "another learner holds this run"
"""How a refusal starts (the launcher recognises it: deploy/failures.py)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a run: the lease's value and the lock file's content (JSON)."""

    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    run_dir: str = ""
    since: float = field(default_factory=time.time)

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes | str) -> Holder:
        try:
            return cls(**json.loads(raw))
        except (ValueError, TypeError):
            return cls(host="?", pid=0, run_dir=str(raw)[:200], since=0.0)

    def describe(self, epoch: int | None = None) -> str:
        since = (
            datetime.datetime.fromtimestamp(self.since).isoformat(timespec="seconds") if self.since else "?"
        )
        where = f"host {self.host}, pid {self.pid}, since {since}"
        return where + (f", epoch {epoch}" if epoch else "") + f", run dir {self.run_dir}"

    def gone(self, me: Holder) -> bool:
        """This holder is a learner of `me`'s host that no longer runs (`me` holds the run dir's lock)."""
        if self.host != me.host:
            return False
        if self.run_dir == me.run_dir:
            return True  # it held this lock while it ran
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class RunClaim:
    """The lock file and the lease of a running learner; `release()` gives both up."""

    def __init__(self, lock_fd: int, lease: Lease, namespace: str):
        self.lock_fd, self.lease, self.namespace = lock_fd, lease, namespace

    def release(self) -> None:
        self.lease.release()
        self.lease.transport.close()
        os.close(self.lock_fd)  # drops the flock


def claim_run(cfg) -> RunClaim:
    """Take the run for this learner (LearnerConfig `cfg`): see the module docstring."""
    run_dir = Path(cfg.run_dir).resolve()
    me = Holder(run_dir=str(run_dir))
    namespace = cfg.broker.namespace
    lock_fd = lock_run_dir(run_dir, namespace)
    transport = cfg.broker.connect()
    lease = Lease(transport, Names(namespace).learner_lease, me.encode(), ttl_s=LEASE_TTL_S)
    try:
        take(lease, me, namespace)
    except BaseException:
        transport.close()
        os.close(lock_fd)
        raise
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, json.dumps({**asdict(me), "epoch": lease.epoch}).encode() + b"\n", 0)
    log.info("this learner holds the run (namespace %s) with epoch %d", namespace, lease.epoch)
    return RunClaim(lock_fd, lease.start(), namespace)


def lock_run_dir(run_dir: Path, namespace: str) -> int:
    """The open, flock-ed lock file of `run_dir`; SystemExit naming its holder when another learner has it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        content = os.pread(fd, 4096, 0)
        os.close(fd)
        info = json.loads(content) if content.strip() else {}
        epoch = info.pop("epoch", None)
        holder = Holder(**info) if info else Holder(host="?", pid=0, run_dir=str(run_dir), since=0.0)
        raise SystemExit(refusal(holder, epoch, namespace)) from None
    return fd


def take(lease: Lease, me: Holder, namespace: str, wait_s: float | None = None) -> None:
    """Take the lease as the module docstring says (waiting up to `wait_s`, LEASE_TTL_S + 1 s by default, for
    a live holder's lease to expire), or raise SystemExit naming its holder."""
    wait_s = LEASE_TTL_S + 1.0 if wait_s is None else wait_s
    state = lease.acquire()
    if state.acquired:
        return
    holder = Holder.decode(state.holder)
    if holder.gone(me):
        state = lease.acquire(replace=state.holder)
        if state.acquired:
            log.warning("took the run over from a learner that no longer runs (%s)", holder.describe())
            return
    log.info("the run is held (%s): waiting up to %.0f s for its lease to expire", holder.describe(), wait_s)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.5)
        state = lease.acquire()
        if state.acquired:
            log.warning("took the run over after its lease expired (%s)", holder.describe())
            return
    raise SystemExit(refusal(Holder.decode(state.holder), state.epoch, namespace))


def refusal(holder: Holder, epoch: int | None, namespace: str) -> str:
    return (
        f"error: {HELD} (broker namespace {namespace}): {holder.describe(epoch)}. A second learner "
        "would rewrite its announcements and train its groups again: stop that one first (or give this one "
        "its own --broker.namespace and --run-dir)"
    )


def lost_message(epoch: int, detail: str) -> str:
    """The exit message of a learner whose lease another learner took."""
    return (
        f"error: this learner (epoch {epoch}) lost the run's lease to another learner; the broker refused "
        f"its write ({detail}). It stops without writing anything more: its unacked groups stay with the run"
    )
