"""Parent side of the grader: hard per-answer timeouts, restarts, and a warm spare process.

`SafeGrader.grade(items)` sends a whole batch of (reward, response, ground truth) items to a grader
process (`reward_service.grader`) and reads the answers one by one, each with its own deadline
(`timeout_s`, counted from the previous answer). When an answer is late the grader is SIGKILLed, the
item scores 0 with `timed_out=True`, a warm spare takes over and the rest of the batch is resent.
A grader that dies (segfault, memory cap) is handled the same way, with `crashed=True`. Results of
identical items are graded once per batch and cached (LRU), so a group of identical pathological answers costs one timeout.
"""

from __future__ import annotations

import hashlib
import os
import select
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from reward_service.grader import _HEADER, GradeRequest, GradeResult, Ready, encode_batch

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
_result_decoder = msgspec.msgpack.Decoder(GradeResult)
_ready_decoder = msgspec.msgpack.Decoder(Ready)


class GraderDied(RuntimeError):
    """The grader process exited or closed its pipe."""


class GraderUnavailable(RuntimeError):
    """No grader process could be started (broken environment); the worker should stop."""


@dataclass(frozen=True)
class Outcome:
    """The graded parts of one item, or why there are none."""

    accuracy: float = 0.0
    format: float = 0.0
    timed_out: bool = False
    """The grading ran past the timeout and was killed."""
    crashed: bool = False
    """The grader process died while grading this item."""
    error: str = ""
    """The reward function raised (the item scores 0)."""
    seconds: float = 0.0
    cached: bool = False
    """Served from the cache of identical items (no grading ran now)."""

    @property
    def failed(self) -> bool:
        return self.timed_out or self.crashed


def _encode(items: list[tuple[str, str, str]], todo: list[int]) -> bytes:
    """The batch of requests `todo`; text that is not valid UTF-8 (lone surrogates) is repaired."""
    try:
        return encode_batch([GradeRequest(i, *items[i]) for i in todo])
    except UnicodeEncodeError:
        return encode_batch([GradeRequest(i, *map(_valid_utf8, items[i])) for i in todo])


def _digest(item: tuple[str, str, str]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in item:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()


def _valid_utf8(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")


class GraderProcess:
    """One `python -m reward_service.grader` child and its framed pipes."""

    def __init__(self, memory_mb: int, preload: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        argv = [sys.executable, "-m", "reward_service.grader", "--memory-mb", str(memory_mb),
                "--preload", preload, "--parent-pid", str(os.getpid())]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env)
        self._fd = self.proc.stdout.fileno()
        self._buffer = bytearray()
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        frame = self.recv(timeout)
        if frame is None:
            raise GraderDied(f"grader {self.proc.pid} not ready after {timeout:.0f} s")
        _ready_decoder.decode(frame)
        self.ready = True

    def send(self, payload: bytes) -> None:
        try:
            self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)
        except (BrokenPipeError, OSError, ValueError) as exc:
            raise GraderDied(f"grader {self.proc.pid} gone: {exc}") from exc

    def recv(self, timeout: float) -> bytes | None:
        """The next frame, or None when none arrived within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while (frame := self._take_frame()) is None:
            left = max(deadline - time.monotonic(), 0.0)
            if not select.select([self._fd], [], [], left)[0]:
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
        frame = bytes(self._buffer[_HEADER.size:end])
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


class SafeGrader:
    """Grades batches under a hard per-item timeout; see the module docstring."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 1024, *, spare: bool = True,
                 startup_timeout_s: float = 120.0, cache_size: int = 4096,
                 preload: str = "math,synthetic") -> None:
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.spare = spare
        self.startup_timeout_s = startup_timeout_s
        self.cache_size = cache_size
        self.preload = preload
        self.timeouts = 0
        self.crashes = 0
        self.restarts = 0
        self._active: GraderProcess | None = None
        self._spare: GraderProcess | None = None
        self._cache: OrderedDict[bytes, Outcome] = OrderedDict()  # keyed by digest: bounded memory

    def start(self) -> None:
        """Start (and wait for) the active grader and, if enabled, the spare."""
        self._ensure_active()

    def grade(self, items: list[tuple[str, str, str]], budget_s: float | None = None) -> list[Outcome]:
        """Outcomes of (reward, response, ground_truth) items, in order.

        `budget_s` bounds the whole batch: each item's timeout shrinks to what is left of it, so a
        batch of many different hanging answers still returns in about `budget_s` seconds.
        """
        deadline = None if budget_s is None else time.monotonic() + budget_s
        results: list[Outcome | None] = [self._cached(item) for item in items]
        first: dict[tuple[str, str, str], int] = {}
        for i, item in enumerate(items):
            if results[i] is None:
                first.setdefault(item, i)
        todo = sorted(first.values())
        sends_failed = 0
        while todo:
            if deadline is not None and time.monotonic() >= deadline:
                for index in todo:  # out of budget: never sent, scored as timed out
                    self.timeouts += 1
                    results[index] = self._remember(items[index], Outcome(timed_out=True))
                break
            grader = self._ensure_active()
            try:
                grader.send(_encode(items, todo))
            except GraderDied:
                sends_failed += 1
                self._discard_active()
                if sends_failed > 2:
                    raise GraderUnavailable("grader processes die on every batch") from None
                continue
            todo = self._collect(grader, todo, items, results, deadline)
        for i, item in enumerate(items):
            if results[i] is None:  # a repeat of an item graded in this batch
                results[i] = replace(results[first[item]], seconds=0.0, cached=True)
        return results  # type: ignore[return-value]

    def _collect(self, grader: GraderProcess, todo: list[int], items, results, deadline) -> list[int]:
        """Read answers for `todo` in order; on a timeout or death return the items still to send."""
        for k, index in enumerate(todo):
            started = time.monotonic()
            timeout = self.timeout_s if deadline is None else min(self.timeout_s, max(deadline - started, 0.0))
            try:
                frame = grader.recv(timeout)
            except GraderDied:
                frame, crashed = None, True
            else:
                crashed = False
            seconds = time.monotonic() - started
            if frame is None:
                self._discard_active()
                if crashed:
                    self.crashes += 1
                else:
                    self.timeouts += 1
                outcome = Outcome(timed_out=not crashed, crashed=crashed, seconds=seconds)
                results[index] = self._remember(items[index], outcome)
                return todo[k + 1:]
            result = _result_decoder.decode(frame)
            if result.id != index:
                raise RuntimeError(f"grader answered item {result.id}, expected {index}")
            outcome = Outcome(result.accuracy, result.format, error=result.error, seconds=seconds)
            results[index] = self._remember(items[index], outcome)
        return []

    def _cached(self, item: tuple[str, str, str]) -> Outcome | None:
        if self.cache_size <= 0:
            return None
        key = _digest(item)
        outcome = self._cache.get(key)
        if outcome is None:
            return None
        self._cache.move_to_end(key)
        return replace(outcome, seconds=0.0, cached=True)

    def _remember(self, item: tuple[str, str, str], outcome: Outcome) -> Outcome:
        if self.cache_size > 0:
            self._cache[_digest(item)] = outcome
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return outcome

    def _ensure_active(self) -> GraderProcess:
        if self._active is None:
            candidates = [self._spare, None] if self._spare is not None else [None]
            self._spare = None
            for candidate in candidates:  # a spare that died while idle gets one fresh replacement
                self._active = candidate or self._spawn()
                try:
                    self._active.wait_ready(self.startup_timeout_s)
                    break
                except GraderDied as exc:
                    self._discard_active()
                    error = exc
            else:
                raise GraderUnavailable(str(error)) from error
        if self.spare and self._spare is None:
            self._spare = self._spawn()
        return self._active

    def _spawn(self) -> GraderProcess:
        return GraderProcess(self.memory_mb, self.preload)

    def _discard_active(self) -> None:
        if self._active is not None:
            self._active.kill()
            self._active = None
            self.restarts += 1

    def close(self) -> None:
        for grader in (self._active, self._spare):
            if grader is not None:
                grader.kill()
        self._active = self._spare = None

    def __enter__(self) -> "SafeGrader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
