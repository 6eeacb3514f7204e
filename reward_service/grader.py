"""The grader process: runs reward functions where a hung or exploding grading can be killed.

`python -m reward_service.grader --memory-mb M` reads framed msgpack batches of `GradeRequest`
from stdin and answers each request, in order, with one framed `GradeResult` on stdout (so the
parent can time out the one item that hangs). Frames are a 4-byte big-endian length followed by
msgpack (msgspec); no pickle. Once its imports are done the process says `Ready`, then caps its
own address space at M MiB (an answer like 10**10**10 raises MemoryError instead of eating the
host) and asks Linux to kill it when its parent dies. It exits on EOF. The parent side, with the
timeouts and restarts, is `reward_service.pool`.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import signal
import struct
import sys
from functools import cache
from typing import BinaryIO

import msgspec

_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30


class GradeRequest(msgspec.Struct, array_like=True):
    """One response to grade with the reward function `reward`."""

    id: int
    reward: str
    response: str
    ground_truth: str


class GradeResult(msgspec.Struct, array_like=True):
    """What the grader said about request `id`; `error` is set when the reward function raised."""

    id: int
    accuracy: float = 0.0
    format: float = 0.0
    error: str = ""


class Ready(msgspec.Struct, array_like=True):
    """First frame of a grader: its imports are done."""

    pid: int


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(list[GradeRequest])


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame's payload, or None at a clean EOF."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes exceeds {MAX_FRAME}")
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return payload


def encode_batch(requests: list[GradeRequest]) -> bytes:
    return _encoder.encode(requests)


@cache
def _reward(name: str):
    from reward_service.rewards import load

    return load(name)


def grade(request: GradeRequest) -> GradeResult:
    """Run one request's reward function; any exception becomes a zero score with `error` set."""
    try:
        parts = _reward(request.reward)(request.response, request.ground_truth)
        return GradeResult(request.id, float(parts.accuracy), float(parts.format))
    except BaseException as exc:  # noqa: BLE001 - MemoryError, RecursionError, sympy internals...
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return GradeResult(request.id, error=f"{type(exc).__name__}: {str(exc)[:200]}")


def _die_with_parent(parent_pid: int) -> None:
    """PR_SET_PDEATHSIG: SIGKILL this process when the parent goes (Linux; no-op elsewhere)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if parent_pid and os.getppid() != parent_pid:
        os._exit(0)  # the parent died before the request above took effect


def _private_stdout() -> BinaryIO:
    """The protocol's channel; fd 1 itself is pointed at stderr so stray prints cannot corrupt it."""
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def _cap_memory(memory_mb: int) -> None:
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def serve(stdin: BinaryIO, stdout: BinaryIO, memory_mb: int, preload: list[str]) -> None:
    """The grader loop: import, say Ready, then answer batches until EOF."""
    for name in preload:
        _reward(name)
    write_frame(stdout, _encoder.encode(Ready(os.getpid())))
    _cap_memory(memory_mb)
    while (payload := read_frame(stdin)) is not None:
        for request in _batch_decoder.decode(payload):
            write_frame(stdout, _encoder.encode(grade(request)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-mb", type=int, default=1024, help="address-space cap; 0 = none")
    parser.add_argument("--preload", default="math,synthetic", help="rewards to import before Ready")
    parser.add_argument("--parent-pid", type=int, default=0, help="exit at once if this is not our parent")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    _die_with_parent(args.parent_pid)
    channel = _private_stdout()
    serve(sys.stdin.buffer, channel, args.memory_mb, [n for n in args.preload.split(",") if n])
    return 0


if __name__ == "__main__":
    sys.exit(main())
