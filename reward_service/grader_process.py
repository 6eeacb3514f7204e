"""One grader child (`python -m reward_service.grader`) seen from the parent: framed pipes, no blocking
writes.

`send` queues a frame and writes what the pipe takes without blocking; `recv(timeout)` waits for
the next answer frame and keeps writing the queued bytes meanwhile. So the parent can queue the
next batch while the grader still works on the current one (the grader reads it when it gets
there), and a batch larger than the pipe buffer never blocks the parent behind a hung grading:
every wait is a `select` with the caller's deadline. The timeouts, restarts and resends are
`reward_service.pool`'s.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from reward_service.grader import _HEADER, Ready

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
_ready_decoder = msgspec.msgpack.Decoder(Ready)


class GraderDied(RuntimeError):
    """The grader process exited or closed its pipe."""


class GraderProcess:
    """One grader child and its framed pipes (stdin non-blocking, with an outgoing buffer)."""

    def __init__(self, memory_mb: int, preload: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        argv = [
            sys.executable,
            "-m",
            "reward_service.grader",
            "--memory-mb",
            str(memory_mb),
            "--preload",
            preload,
            "--parent-pid",
            str(os.getpid()),
        ]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env)
        self._fd = self.proc.stdout.fileno()
        self._in_fd = self.proc.stdin.fileno()
        os.set_blocking(self._in_fd, False)
        self._buffer = bytearray()
        self._out = bytearray()
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        frame = self.recv(timeout)
        if frame is None:
            raise GraderDied(f"grader {self.proc.pid} not ready after {timeout:.0f} s")
        _ready_decoder.decode(frame)
        self.ready = True

    def send(self, payload: bytes) -> None:
        """Queue one frame and write as much of the queue as the pipe takes now."""
        self._out += _HEADER.pack(len(payload))
        self._out += payload
        self._flush()

    def _flush(self) -> None:
        try:
            while self._out:
                written = os.write(self._in_fd, self._out)
                del self._out[:written]
        except BlockingIOError:
            pass
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise GraderDied(f"grader {self.proc.pid} gone: {exc}") from exc

    def recv(self, timeout: float) -> bytes | None:
        """The next frame, or None when none arrived within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (frame := self._take_frame()) is None:
            left = max(deadline - time.monotonic(), 0.0)
            readable, writable, _ = select.select([self._fd], [self._in_fd] if self._out else [], [], left)
            if writable:
                self._flush()
            if not readable:
                if writable:
                    continue
                return None
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                raise GraderDied(f"grader {self.proc.pid} exited ({self.proc.poll()})")
            self._buffer += chunk
        return frame

    def _take_frame(self) -> bytes | None:
        if len(self._buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buffer)
        end = _HEADER.size + size
        if len(self._buffer) < end:
            return None
        frame = bytes(self._buffer[_HEADER.size : end])
        del self._buffer[:end]
        return frame

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass
