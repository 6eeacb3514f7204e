"""Supervision of the child processes the all-in-one launcher starts.

`ProcessGroup` starts each role as its own OS process (own session, so Ctrl-C reaches only the
launcher, which then stops the children in reverse start order: SIGINT, then SIGTERM, then SIGKILL),
sends each child's output to `<run_dir>/logs/<name>.log`, and watches them (`check()`, called
by the launcher about once a second):
  * a child started with `restarts=N` that exits non-zero (crash, kill -9, OOM) is started again
    with the same command line, at most N times: at once the first time, then after 1, 2, 4 ...
    seconds (capped at 30 s); each restart is counted (`Child.restarts`), marked in its log and
    reported to `on_restart` (the launcher logs it in events.jsonl and the live progress). The budget
    refills: a child that stayed up `refill_s` since its last restart (10 minutes by default) gets all N
    back and its back-off starts over, so that outages hours apart never add up to the end of a run.
    Exit code 0 is a finished child and is never restarted, nor is one whose exit the group's
    `classify` (the launcher's: deploy.failures.classify) recognises as a known failure that a restart
    cannot mend (disk full, a damaged checkpoint: action "stop"), or as the same known failure as before
    its last restart (out of GPU memory twice: action "repeat", a third try would fail again);
  * a running child whose heartbeat (runtime/heartbeat.py: a file in <run_dir>/heartbeats/ its loop
    touches as it turns) stayed silent for `watchdog_s` is stuck (stopped, hung): it is logged, killed
    (SIGKILL to its process group) and restarted like a crash, its exit classified "no progress".
    A child that never beat (a build, a warm start, vLLM still loading) is not watched;
  * a critical child that exits, or a restartable one that ran out of restarts, raises
    `ChildDied` with the tail of its log.
`child_env` is the environment every child gets (thread counts, PYTHONPATH, the run id in
RUN_ID_ENV); `free_port` / `port_open` pick and probe loopback ports.
The roles make restarts safe: each resumes from its durable state (the learner from its last
checkpoint, the others from the broker) and re-reads the entries it held, under the same
consumer name.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deploy.failures import Failure
from runtime.heartbeat import HEARTBEAT_ENV

ROOT = Path(__file__).resolve().parents[1]
RUN_ID_ENV = "PARALLAX_RUN_ID"
"""Every process of a run carries this variable (its value: the run id), grandchildren included."""
RESTART_BACKOFF_CAP_S = 30.0
"""Longest wait before a restart (the n-th restart since the budget refilled waits min(2 ** (n - 2), cap)
s; the first none)."""


HUNG_FIX = (
    "it made no progress for {watchdog_s:.0f} s (stopped or hung; its log shows where it was) and was "
    "restarted; if it is only slow (a long step, a large checkpoint), raise --watchdog-s"
)


class ChildDied(RuntimeError):
    """A supervised process exited while the run was still going."""


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path
    critical: bool = True
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    max_restarts: int = 0
    """Restarts allowed after a non-zero exit (0: none)."""
    restarts: int = 0
    """Restarts done so far (in all: what the live progress shows)."""
    refilled_at: int = 0
    """`restarts` when the budget last refilled (budget left: max_restarts - (restarts - refilled_at))."""
    started: float = field(default_factory=time.monotonic)
    """When its current run started (time.monotonic())."""
    spawned: float = field(default_factory=time.time)
    """When its current run started (time.time(): heartbeat files older than this are a previous run's)."""
    hung: bool = False
    """The watchdog killed its current run (no heartbeat for `ProcessGroup.watchdog_s`)."""
    restart_at: float | None = None
    """When the pending restart is due (time.monotonic()), None when none is pending."""
    log_start: int = 0
    """Size of the log when this child was (re)started: what its current run wrote comes after."""
    failure: Failure | None = None
    """The known failure (`ProcessGroup.classify`) its last exit showed, None if none."""
    repeated: bool = False
    """Its last exit repeated the known failure of the one before: not restarted again."""

    @property
    def used(self) -> int:
        """Restarts spent since the budget last refilled."""
        return self.restarts - self.refilled_at

    @property
    def final(self) -> bool:
        """Its last exit showed a failure that a restart cannot mend (action "stop"), or repeated one."""
        return self.repeated or (self.failure is not None and self.failure.action == "stop")

    @property
    def gave_up(self) -> bool:
        """True when this child exited non-zero and may not be restarted again."""
        code = self.popen.poll()
        limit = self.used >= self.max_restarts or self.final
        return code not in (None, 0) and self.max_restarts > 0 and limit


@dataclass
class ProcessGroup:
    """The processes of one run; use as a context manager so they are always stopped."""

    run_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)
    on_restart: Callable[[Child, int], None] | None = None
    """Called with (child, the exit code it had) right after a child was started again."""
    classify: Callable[[str], Failure | None] | None = None
    """The known failure a log's text shows (None if none): see the module docstring."""
    refill_s: float = 600.0
    """A child up this long since its last restart gets its whole restart budget back (0: never)."""
    watchdog_s: float = 0.0
    """A child whose heartbeat stayed silent this long is killed and restarted (0: not watched)."""

    def start(
        self,
        name: str,
        argv: list[str],
        *,
        critical: bool = True,
        env: dict | None = None,
        restarts: int = 0,
    ) -> Child:
        """Start `argv` (a python -m ... command line or any program) as a supervised child;
        `restarts`: how many times to start it again after a non-zero exit."""
        full_env = {**os.environ, **self.env, **(env or {}), "PYTHONUNBUFFERED": "1"}
        full_env[HEARTBEAT_ENV] = str(self.heartbeat_prefix(name))
        log_path = self.run_dir / "logs" / f"{name}.log"
        start = _size(log_path)
        child = Child(
            name, self._spawn(argv, full_env, log_path), log_path, critical, list(argv), full_env, restarts
        )
        child.log_start = start
        self.children.append(child)
        return child

    def heartbeat_prefix(self, name: str) -> Path:
        """Child `name`'s heartbeat file (a process with several workers adds "-<i>" for each)."""
        return self.run_dir / "heartbeats" / name

    def python(self, name: str, module: str, args: list[str], **kw) -> Child:
        return self.start(name, [sys.executable, "-m", module, *args], **kw)

    @staticmethod
    def _spawn(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def check(self) -> None:
        """Restart restartable children that died (when their back-off is over); raise ChildDied
        (with the log's tail) for a critical child that exited or a child out of restarts."""
        for child in self.children:
            code = child.popen.poll()
            if code is None:
                self._refill(child)
                self._watch(child)
                continue
            if code != 0 and child.used < child.max_restarts and not self._final(child):
                self._restart(child, code)
            elif child.critical or child.gave_up:
                how = f"exited with code {code}"
                if child.repeated:
                    how += f" the same way as before its restart {child.restarts}: not restarted again"
                elif child.final:
                    how += f" ({child.failure.kind}): not restarted, a restart would fail the same way"
                elif child.gave_up:
                    how += (
                        f" after {child.used} restarts within {self.refill_s:.0f} s of each other (the limit)"
                    )
                raise ChildDied(f"{child.name} {how}; last log lines:\n{tail(child.log_path)}")

    def _refill(self, child: Child) -> None:
        """A running child that stayed up `refill_s` since its last restart gets its budget back."""
        if child.used and self.refill_s > 0 and time.monotonic() - child.started >= self.refill_s:
            child.refilled_at = child.restarts
            note = f"\n--- supervisor: up {self.refill_s:.0f} s: {child.max_restarts} restarts again\n"
            with open(child.log_path, "ab") as log:
                log.write(note.encode())

    def _watch(self, child: Child) -> None:
        """Kill a running child whose heartbeat went silent for `watchdog_s` (see the module docstring)."""
        if self.watchdog_s <= 0 or child.hung:
            return
        prefix = self.heartbeat_prefix(child.name)
        beats = [_mtime(p) for p in [prefix, *prefix.parent.glob(f"{prefix.name}-*")]]
        beats = [t for t in beats if t is not None and t >= child.spawned]  # this run's
        silent_s = time.time() - min(beats, default=time.time())
        if silent_s <= self.watchdog_s:
            return
        child.hung = True
        note = f"\n--- supervisor: no progress for {silent_s:.0f} s (heartbeat {prefix}): killing it\n"
        with open(child.log_path, "ab") as log:
            log.write(note.encode())
        _signal_group(child.popen, signal.SIGKILL)  # a stopped process dies of SIGKILL too

    def _final(self, child: Child) -> bool:
        """Whether this exit may not be restarted: a known failure that a restart cannot mend, or the same
        known failure as the previous exit where that ends a run (worked out once per exit: while a restart
        waits out its back-off the answer stands)."""
        if child.hung:  # killed by the watchdog: a crash like any other, restarted
            child.hung, child.repeated = False, False
            child.failure = Failure("no progress", HUNG_FIX.format(watchdog_s=self.watchdog_s), "retry")
            return False
        if self.classify is None or child.restart_at is not None:
            return child.final
        try:
            with open(child.log_path, "rb") as log:
                log.seek(child.log_start)
                text = log.read().decode(errors="replace")
        except OSError:
            text = ""
        failure, previous = self.classify(text), child.failure
        child.repeated = failure is not None and failure.action == "repeat" and failure == previous
        child.failure = failure
        return child.final

    def _restart(self, child: Child, code: int) -> None:
        now = time.monotonic()
        if child.restart_at is None:
            wait_s = 0.0 if child.used == 0 else min(2.0 ** (child.used - 1), RESTART_BACKOFF_CAP_S)
            child.restart_at = now + wait_s
        if now < child.restart_at:
            return
        child.restart_at = None
        child.restarts += 1
        child.started, child.spawned = time.monotonic(), time.time()
        with open(child.log_path, "ab") as log:
            note = f"\n--- supervisor: exit code {code}, restart {child.used}/{child.max_restarts}\n"
            log.write(note.encode())
        child.log_start = _size(child.log_path)
        child.popen = self._spawn(child.argv, child.env, child.log_path)
        if self.on_restart is not None:
            self.on_restart(child, code)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every child, newest first: SIGINT, then SIGTERM, then SIGKILL."""
        for child in self.children:
            child.max_restarts = child.used  # stopping: nothing is started again
        for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            alive = [c for c in reversed(self.children) if c.popen.poll() is None]
            for child in alive:
                _signal_group(child.popen, sig)
            deadline = time.monotonic() + wait_s
            for child in alive:
                try:
                    child.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(popen: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def child_env(threads: int, run_id: str) -> dict[str, str]:
    """Environment of every child: thread counts, the repository on PYTHONPATH, the run id."""
    n = str(max(threads, 1))
    return {
        "OMP_NUM_THREADS": n,
        "MKL_NUM_THREADS": n,
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        RUN_ID_ENV: run_id,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
