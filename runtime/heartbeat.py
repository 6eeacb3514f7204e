"""A role's heartbeat: a small file whose modification time says when its loop last turned.

    beat = Heartbeat.from_env()          # the path the launcher gave in $PARALLAX_HEARTBEAT ("" = off)
    beat()                               # once per turn of the role's loop (cheap: a touch a second at most)

Each role beats where its loop turns, working or waiting for work (the learner while it collects a step,
the generator where it applies weights before every batch and while its staleness gate holds, each reward
worker once per loop), so a heartbeat goes silent only when the process is stuck: stopped (SIGSTOP), hung
in a call that never returns, or in a step far longer than usual. The launcher's watchdog
(deploy/processes.py) kills and restarts a process whose heartbeat stayed silent for `--watchdog-s`.
A process with several workers gives each its own file (`suffix`, e.g. "-0"). Without the variable (a
role started by hand) nothing is written.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

HEARTBEAT_ENV = "PARALLAX_HEARTBEAT"
"""The path prefix of a process's heartbeat file, set by the launcher for each process it starts."""


class Heartbeat:
    """Touches `path` at most every `every_s` seconds; a no-op without a path."""

    def __init__(self, path: str | os.PathLike | None, every_s: float = 1.0):
        self.path = Path(path) if path else None
        self.every_s = every_s
        self._last = float("-inf")

    @classmethod
    def from_env(cls, suffix: str = "") -> Heartbeat:
        prefix = os.environ.get(HEARTBEAT_ENV, "")
        return cls(prefix + suffix if prefix else None)

    def __call__(self) -> None:
        now = time.monotonic()
        if self.path is None or now - self._last < self.every_s:
            return
        self._last = now
        with contextlib.suppress(OSError):  # a heartbeat never stops the work (a full disk, say)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.touch()
