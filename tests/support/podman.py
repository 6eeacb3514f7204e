"""Podman as the engine behind `docker compose`, on a machine with no Docker daemon and no image registry.

    engine = Podman(cache_dir)            # its own containers.conf (runc, cgroupfs, no raised ulimits)
    engine.base_image()                   # Debian bookworm (minbase) made by debootstrap, tarball cached
    engine.build(tag, containerfile, ...) # podman build --network host, from the local base
    with engine.api() as docker_host:     # podman's Docker API on a socket: DOCKER_HOST for docker compose
        with engine.healthchecks(name):   # runs their healthchecks (podman 4.3 needs systemd timers)

Everything stays under `cache_dir` (the base tarball, wheels for the builds) or in podman's own store;
nothing outside it is changed. Used by tests/compose/ (`./run test-compose`); docs/compose.md tells how
the same steps run by hand.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

CONTAINERS_CONF = """\
# podman for tests/compose: runc and cgroupfs (crun refuses a hybrid cgroup tree), no raised ulimits (a
# sandbox may refuse RLIMIT_NOFILE/NPROC), events in a file (no journald)
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
events_logger = "file"
"""
BASE_TAG = "localhost/parallax-test-base:bookworm"
DEBIAN_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


class Podman:
    """The podman CLI under its own configuration, with timings of what it did."""

    def __init__(self, cache_dir: Path):
        self.cache = Path(cache_dir)
        self.cache.mkdir(parents=True, exist_ok=True)
        conf = self.cache / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}
        self.timings: dict[str, float] = {}

    def run(self, *args: str, check: bool = True, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout, **kw
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return done

    def has_image(self, tag: str) -> bool:
        return self.run("image", "exists", tag, check=False).returncode == 0

    @contextlib.contextmanager
    def timed(self, name: str):
        t0 = time.monotonic()
        yield
        self.timings[name] = round(time.monotonic() - t0, 1)

    def base_image(self) -> str:
        """Debian bookworm minbase as BASE_TAG: imported from the cached tarball, made by debootstrap once."""
        if self.has_image(BASE_TAG):
            return BASE_TAG
        tarball = self.cache / f"debian-{DEBIAN_SUITE}-minbase.tar"
        with self.timed("base image"):
            if not tarball.is_file():
                rootfs = self.cache / "rootfs.tmp"
                shutil.rmtree(rootfs, ignore_errors=True)
                argv = ["debootstrap", "--variant=minbase", DEBIAN_SUITE, str(rootfs), debian_mirror()]
                done = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
                if done.returncode != 0:
                    raise RuntimeError(f"debootstrap failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
                partial = tarball.with_suffix(".tmp")
                subprocess.run(["tar", "-C", str(rootfs), "-cf", str(partial), "."], check=True, timeout=600)
                partial.rename(tarball)
                shutil.rmtree(rootfs, ignore_errors=True)
            self.run("import", str(tarball), BASE_TAG)
        return BASE_TAG

    def build(
        self,
        tag: str,
        containerfile: Path,
        context: Path,
        args: dict[str, str] | None = None,
        volumes: dict[Path, str] | None = None,
        timeout: float = 3600,
    ) -> str:
        """podman build --network host (apt and pip reach their registries as on the host); `volumes`
        are mounted into the RUN steps (a folder of wheels)."""
        argv = ["build", "--network", "host", "-f", str(containerfile), "-t", tag]
        for key, value in (args or {}).items():
            argv += ["--build-arg", f"{key}={value}"]
        for host, inside in (volumes or {}).items():
            if not Path(host).exists():
                Path(host).mkdir(parents=True)
            argv += ["-v", f"{host}:{inside}"]
        with self.timed(f"build {tag}"):
            self.run(*argv, str(context), timeout=timeout)
        return tag

    @contextlib.contextmanager
    def api(self):
        """podman's Docker API on a socket of its own; yields the DOCKER_HOST value."""
        sock = self.cache / "run" / "podman.sock"
        sock.parent.mkdir(parents=True, exist_ok=True)
        sock.unlink(missing_ok=True)
        log = open(self.cache / "run" / "podman-service.log", "w")
        service = subprocess.Popen(
            ["podman", "system", "service", "--time=0", f"unix://{sock}"],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 30
            while not sock.exists():
                if service.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"podman system service did not start: see {log.name}")
                time.sleep(0.2)
            yield f"unix://{sock}"
        finally:
            service.terminate()
            try:
                service.wait(timeout=20)
            except subprocess.TimeoutExpired:
                service.kill()
            log.close()

    @contextlib.contextmanager
    def healthchecks(self, project: str, every_s: float = 2.0):
        """Run the healthchecks of the project's running containers every `every_s` (podman 4.3 schedules
        them with systemd timers, which a machine without systemd lacks; Docker runs them itself)."""
        stop = threading.Event()

        def pump() -> None:
            while not stop.wait(every_s):
                listed = self.run(
                    "ps", "--filter", f"label=com.docker.compose.project={project}", "--format", "{{.ID}}",
                    check=False,
                )  # fmt: skip
                for container in listed.stdout.split():
                    self.run("healthcheck", "run", container, check=False, timeout=60)

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=70)


def debian_mirror() -> str:
    """The Debian mirror apt is configured with ($PARALLAX_DEBIAN_MIRROR first), else deb.debian.org."""
    if os.environ.get("PARALLAX_DEBIAN_MIRROR"):
        return os.environ["PARALLAX_DEBIAN_MIRROR"]
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in sources:
        with contextlib.suppress(OSError):
            for url in re.findall(r"(?:^deb\s+(?:\[[^]]*\]\s+)?|^URIs:\s*)(\S+)", path.read_text(), re.M):
                if "security" not in url:
                    return url
    return DEFAULT_MIRROR
