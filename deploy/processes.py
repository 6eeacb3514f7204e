"""Supervision of the child processes the all-in-one launcher starts.

`ProcessGroup` starts each role as its own OS process (own session, so Ctrl-C reaches only the
launcher, which then stops the children in reverse start order: SIGINT, then SIGTERM, then SIGKILL),
sends each child's output to `<run_dir>/logs/<name>.log`, and reports a child that died early.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


class ChildDied(RuntimeError):
    """A supervised process exited while the run was still going."""


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    log_path: Path
    critical: bool = True


@dataclass
class ProcessGroup:
    """The processes of one run; use as a context manager so they are always stopped."""

    run_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], *, critical: bool = True, env: dict | None = None) -> Child:
        """Start `argv` (a python -m ... command line or any program) as a supervised child."""
        log_dir = self.run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"{name}.log"
        full_env = {**os.environ, **self.env, **(env or {}), "PYTHONUNBUFFERED": "1"}
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )
        child = Child(name, popen, log_path, critical)
        self.children.append(child)
        return child

    def python(self, name: str, module: str, args: list[str], **kw) -> Child:
        return self.start(name, [sys.executable, "-m", module, *args], **kw)

    def check(self) -> None:
        """Raise ChildDied (with the log's tail) if a critical child has exited."""
        for child in self.children:
            code = child.popen.poll()
            if code is not None and child.critical:
                raise ChildDied(
                    f"{child.name} exited with code {code}; last log lines:\n{tail(child.log_path)}"
                )

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every child, newest first: SIGINT, then SIGTERM, then SIGKILL."""
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


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
