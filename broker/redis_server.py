"""Start and stop a local `redis-server` (for the launcher, the benchmark and the tests).

`LocalRedis().start()` runs redis-server on a free loopback port, in memory only, with a password
drawn for it (`LocalRedis.url` carries it), waits until it answers PING, and `stop()` terminates
exactly that process. With `data_dir`, the server keeps an append-only file there (AOF with
appendfsync everysec, no RDB snapshots), so `kill()` then `start()` on the same port comes back
with every stream, group, pending entry and value it had acknowledged.

The settings (`redis_config`) never go on a command line, where `ps` would show the password to
every user of the host: `LocalRedis` hands them to `redis-server -` on its stdin, and the launcher
writes them to a 0600 file in its 0700 run directory (`write_redis_config`) so that a supervised
restart reads them again. The password belongs to Redis's `default` user, whose ACL allows every
command but the `@dangerous` ones (CONFIG, SHUTDOWN, FLUSHALL, FLUSHDB, DEBUG, KEYS, MONITOR, ...):
a role, or anyone holding the password, can use the streams but not reconfigure or wipe the server.

Why everysec and not always: Redis write(2)s the AOF buffer before it sends the replies of an
event-loop iteration, so a killed redis-server (kill -9, OOM) loses nothing it acknowledged
under either setting; only a crash of the whole host can lose up to one second of writes with
everysec, and on one host that crash takes the learner's unsynced state with it. always would
fsync on every write, on the path of every publish and ack.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(process: subprocess.Popen | None, grace_s: float = 5.0) -> None:
    """Terminate a child that is still running; kill it if it has not exited after `grace_s`."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


ROLE_ACL = "~* &* +@all -@dangerous"
"""What the password's user may do: every key and channel, every command but the @dangerous ones."""
MAX_BULK_BYTES = 64 * 1024 * 1024
"""Largest single argument the server accepts (Redis's own default is 512 MB): above every entry and
blob cap of `broker.stream_options.StreamOptions`, so only a hostile client ever meets it."""


def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server, or ./run setup)")
    return binary


def redis_config(port: int, password: str, *, data_dir: str | None = None) -> str:
    """redis.conf text: loopback only, the password's user without @dangerous commands; with `data_dir`,
    AOF (everysec) there, else in memory only."""
    if not password or any(c.isspace() or c in "\"'" for c in password):
        raise ValueError("the redis password must be non-empty, without spaces or quotes")
    lines = [
        f"port {port}",
        "bind 127.0.0.1",
        "protected-mode yes",
        'save ""',
        f"proto-max-bulk-len {MAX_BULK_BYTES}",
        f"user default on >{password} {ROLE_ACL}",
    ]
    if data_dir is None:
        lines.append("appendonly no")
    else:
        lines += [f'dir "{data_dir}"', "appendonly yes", "appendfsync everysec"]
    return "\n".join(lines) + "\n"


def write_redis_config(path: Path, port: int, password: str, *, data_dir: str | None = None) -> list[str]:
    """Write `redis_config` to `path` (mode 0600) and return the command line that reads it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(redis_config(port, password, data_dir=data_dir))
    os.chmod(path, 0o600)
    return [redis_binary(), str(path)]


class LocalRedis:
    """One redis-server child process on a free loopback port; use as a context manager."""

    def __init__(self, password: str | None = None, port: int | None = None, data_dir: str | None = None):
        self.password = password or secrets.token_urlsafe(24)
        """The `default` user's password (drawn here unless given)."""
        self.port = port or free_port()
        self.data_dir = data_dir
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        config = redis_config(self.port, self.password, data_dir=self.data_dir)
        self.process = subprocess.Popen(
            [redis_binary(), "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.process.stdin.write(config.encode())  # the settings never show in `ps`
        self.process.stdin.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace")
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {err}")
            if self._answers_ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout_s}s")

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                pw = self.password.encode()
                sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw))
                if not sock.recv(64).startswith(b"+OK"):
                    return False
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        stop_process(self.process)

    def kill(self) -> None:
        """SIGKILL the server (a crash: no shutdown, no final AOF rewrite) and reap it."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> LocalRedis:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
