"""Start and stop a local `redis-server` (for the launcher, the benchmark and the tests).

`LocalRedis(password=None).start()` runs `redis-server --port <free> --save '' --appendonly no`
(in-memory only), waits until it answers PING, and `stop()` terminates exactly that process.
With `data_dir`, the server keeps an append-only file there (`redis_server_argv`: AOF with
appendfsync everysec, no RDB snapshots), so `kill()` then `start()` on the same port comes back
with every stream, group, pending entry and value it had acknowledged.

Why everysec and not always: Redis write(2)s the AOF buffer before it sends the replies of an
event-loop iteration, so a killed redis-server (kill -9, OOM) loses nothing it acknowledged
under either setting; only a crash of the whole host can lose up to one second of writes with
everysec, and on one host that crash takes the learner's unsynced state with it. always would
fsync on every write, on the path of every publish and ack.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time


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


def redis_server_argv(port: int, *, data_dir: str | None = None, password: str | None = None) -> list[str]:
    """The redis-server command line: loopback only; with `data_dir`, AOF (everysec) there."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server, or ./run setup)")
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    if data_dir is None:
        cmd += ["--appendonly", "no"]
    else:
        cmd += ["--dir", str(data_dir), "--appendonly", "yes", "--appendfsync", "everysec"]
    if password:
        cmd += ["--requirepass", password]
    return cmd


class LocalRedis:
    """One redis-server child process on a free loopback port; use as a context manager."""

    def __init__(self, password: str | None = None, port: int | None = None, data_dir: str | None = None):
        self.password = password
        self.port = port or free_port()
        self.data_dir = data_dir
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        cmd = redis_server_argv(self.port, data_dir=self.data_dir, password=self.password)
        self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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
                if self.password:
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
