"""deploy/docker-compose.yml: structure, wiring and consistency with Prometheus and docs/metrics.md.

There is no Docker engine here. `docker compose config` (which needs no engine) runs when the
docker CLI and its compose plugin are installed; the structural checks with PyYAML always run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from runtime.config import parse_gpus
from tests.support.compose import interpolate

ROOT = Path(__file__).resolve().parents[3]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
ENV = {
    "REDIS_PASSWORD": "s3cret-test-pw",
    "PARALLAX_AUTH_KEY": "message-test-key",
    "GRAFANA_ADMIN_PASSWORD": "admin-test-pw",
}
SERVICES = {"redis", "redis_exporter", "reward_service", "generator", "learner", "prometheus", "grafana"}
ROLES = {"reward_service": ("reward", 9101), "generator": ("generator", 9201), "learner": ("learner", 9301)}


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(raw) -> dict:
    return interpolate(raw, ENV)


@pytest.fixture(scope="module")
def prometheus() -> dict:
    return yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def exposed_ports(service: dict) -> set[int]:
    ports = set()
    for item in service.get("expose", []):
        lo, _, hi = str(item).partition("-")
        ports.update(range(int(lo), int(hi or lo) + 1))
    return ports


def scrape_targets(prometheus: dict) -> dict[str, set[tuple[str, int]]]:
    """job -> {(host, port)} from static and DNS service discovery."""
    jobs: dict[str, set[tuple[str, int]]] = {}
    for job in prometheus["scrape_configs"]:
        found = jobs.setdefault(job["job_name"], set())
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                found.add((host, int(port)))
        for sd in job.get("dns_sd_configs", []):
            found.update((name, int(sd["port"])) for name in sd["names"])
    return jobs


def metric_instances(service: str, command: list[str]) -> int:
    """How many metrics ports a role's process tree serves (see docs/metrics.md)."""
    if service == "reward_service":
        return int(flag(command, "--workers"))
    if service == "generator":
        return len(parse_gpus(flag(command, "--gpus"))) // int(flag(command, "--tp") or 1)
    return 1


def test_all_services_present(compose):
    assert SERVICES <= set(compose["services"])


@pytest.mark.parametrize("missing", sorted(ENV))
def test_required_variables_are_required(raw, missing):
    with pytest.raises(KeyError, match=missing):
        interpolate(raw, {k: v for k, v in ENV.items() if k != missing})


def test_entry_commands(compose):
    cmds = {name: compose["services"][name]["command"] for name in ROLES}
    assert cmds["learner"][:5] == ["python", "-m", "learner", "--gpus", "0-5"]
    assert flag(cmds["learner"], "--config") == "deploy/configs/learner.toml"
    assert cmds["generator"][:5] == ["python", "-m", "generator", "--gpus", "6-7"]
    assert flag(cmds["generator"], "--config") == "deploy/configs/generator.toml"
    assert cmds["reward_service"][:5] == ["python", "-m", "reward_service", "--workers", "4"]
    assert flag(cmds["reward_service"], "--config") == "deploy/configs/reward.toml"


@pytest.mark.parametrize("service", sorted(ROLES))
def test_command_module_exists(compose, service):
    command = compose["services"][service]["command"]
    module = command[command.index("-m") + 1]
    assert (ROOT / module / "__init__.py").is_file(), f"{module} is not a package of the repo"
    if importlib.util.find_spec(f"{module}.__main__") is None:
        pytest.skip(f"{module}/__main__.py not written yet")


def test_gpu_services_reserve_gpus_and_use_disjoint_ones(compose):
    used: dict[str, set[int]] = {}
    for name in ("learner", "generator"):
        svc = compose["services"][name]
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        # --gpus holds host indices: only with every device visible do they mean the same in the container
        assert device.get("count") == "all" and "device_ids" not in device
        used[name] = set(parse_gpus(flag(svc["command"], "--gpus")))
        assert svc["ipc"] == "host", "NCCL weight sync between containers needs the host IPC namespace"
    assert used["learner"] and used["generator"] and not used["learner"] & used["generator"]
    assert (
        "deploy" not in compose["services"]["reward_service"]
        or "resources" not in compose["services"]["reward_service"]["deploy"]
    )


def test_reward_service_scales(raw, compose):
    svc = compose["services"]["reward_service"]
    assert int(svc["deploy"]["replicas"]) >= 1
    assert "REWARD_REPLICAS" in raw["services"]["reward_service"]["deploy"]["replicas"]
    for key in ("container_name", "ports", "hostname"):
        assert key not in svc, f"reward_service.{key} would stop `--scale reward_service=N`"


@pytest.mark.parametrize("service", sorted(ROLES))
def test_metrics_ports_match_prometheus_and_the_catalogue(compose, prometheus, service):
    job, base = ROLES[service]
    svc = compose["services"][service]
    assert int(flag(svc["command"], "--metrics.port")) == base
    assert flag(svc["command"], "--metrics.host") == "0.0.0.0", "Prometheus scrapes from another container"
    expected = set(range(base, base + metric_instances(service, svc["command"])))
    assert exposed_ports(svc) == expected
    assert scrape_targets(prometheus)[job] == {(service, p) for p in expected}
    assert f"127.0.0.1:{base}/metrics" in " ".join(svc["healthcheck"]["test"])


def test_every_scrape_target_is_a_port_some_service_exposes(compose, prometheus):
    for job, targets in scrape_targets(prometheus).items():
        for host, port in targets:
            if job == "prometheus":
                assert (host, port) == ("localhost", 9090)
                continue
            assert host in compose["services"], f"{job}: {host} is not a compose service"
            assert port in exposed_ports(compose["services"][host]), f"{job}: {host} does not expose {port}"
    assert scrape_targets(prometheus)["redis"] == {("redis_exporter", 9121)}


def test_redis_password_and_persistence(raw, compose):
    redis = compose["services"]["redis"]
    assert redis["entrypoint"] == ["/bin/sh", "-c"]
    (script,) = redis["command"]
    assert "redis_password" in redis["secrets"]
    assert '"$(cat /run/secrets/redis_password)"' in script, "the password comes from the secret file"
    assert "| exec docker-entrypoint.sh redis-server - " in script, "and reaches redis-server on its stdin"
    assert ENV["REDIS_PASSWORD"] not in script and "REDIS_PASSWORD" not in script
    assert "-@dangerous" in script and "+config|set" not in script, "no CONFIG SET, SHUTDOWN, FLUSHALL"
    assert "--appendonly yes" in script
    assert "--maxmemory-policy noeviction" in script, "evicting a stream would lose work"
    assert "REDISCLI_AUTH" not in (redis.get("environment") or {})
    assert "/run/secrets/redis_password" in " ".join(redis["healthcheck"]["test"]), (
        "the healthcheck must authenticate"
    )
    assert "redis_data:/data" in redis["volumes"]
    exporter = compose["services"]["redis_exporter"]["environment"]
    assert exporter["REDIS_PASSWORD"] == ENV["REDIS_PASSWORD"]
    assert "parallax:rollouts" in exporter["REDIS_EXPORTER_CHECK_STREAMS"]
    assert compose["secrets"] == {
        "redis_password": {"environment": "REDIS_PASSWORD"},
        "message_key": {"environment": "PARALLAX_AUTH_KEY"},
    }
    for name in ROLES:
        service = compose["services"][name]
        command = service["command"]
        assert flag(command, "--broker.url") == "redis://redis:6379/0", name
        assert flag(command, "--broker.password-file") == "/run/secrets/redis_password", name
        assert flag(command, "--broker.auth-key-file") == "/run/secrets/message_key", name
        assert set(service["secrets"]) == {"redis_password", "message_key"}, name
        for secret in (ENV["REDIS_PASSWORD"], ENV["PARALLAX_AUTH_KEY"]):
            assert secret not in " ".join(command), f"{name}: a secret on a command line shows in ps"
            assert secret not in str(service.get("environment")), f"{name}: use the secret file"


def test_prometheus_cannot_be_stopped_or_reloaded_over_http(compose):
    assert not any("lifecycle" in a for a in compose["services"]["prometheus"]["command"])


def test_no_secret_is_written_in_the_file(raw):
    secrets = 0
    for name, svc in raw["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            if re.search(r"PASSWORD|AUTH|SECRET|TOKEN", key):
                assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]*\}", str(value)), f"{name}.{key} is hard-coded"
                secrets += 1
    assert secrets >= 2  # redis_exporter, grafana admin
    for name, secret in raw["secrets"].items():
        assert set(secret) == {"environment"}, f"secret {name} must come from deploy/.env"


def test_volumes_are_declared_and_bind_mounts_exist(compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, svc in compose["services"].items():
        for spec in svc.get("volumes", []):
            source = spec.split(":")[0]
            if source.startswith((".", "/")):
                if source.startswith("./") and source not in ("./models", "./data"):
                    assert (DEPLOY / source).exists(), f"{name}: {source} missing"
            else:
                assert source in declared, f"{name}: volume {source} not declared"
                used.add(source)
    assert {"redis_data", "prometheus_data", "grafana_data"} <= used


def test_healthchecks_and_dependencies(compose):
    services = compose["services"]
    for name, svc in services.items():
        if name != "redis_exporter":  # a scratch image: no shell, no wget
            assert "healthcheck" in svc, f"{name} has no healthcheck"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond["condition"] in (
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            )
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], (
                    f"{name} waits for {dep} to be healthy, which has no healthcheck"
                )
    for name in (*ROLES, "redis_exporter"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy", name
    assert services["grafana"]["depends_on"]["prometheus"]["condition"] == "service_healthy"
    _assert_acyclic({n: set(s.get("depends_on") or {}) for n, s in services.items()})


def test_builds_and_provisioned_config_mounts(compose):
    for name, svc in compose["services"].items():
        if "build" in svc:
            context = (DEPLOY / svc["build"]["context"]).resolve()
            assert context == ROOT, name
            assert (context / svc["build"]["dockerfile"]).is_file(), name
    prom = compose["services"]["prometheus"]
    assert "./prometheus:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]


def test_env_example_lists_every_required_variable(raw):
    required = set(re.findall(r"\$\{([A-Z_]+):\?", COMPOSE.read_text()))
    example = (DEPLOY / "env.example").read_text()
    assert required == {"REDIS_PASSWORD", "PARALLAX_AUTH_KEY", "GRAFANA_ADMIN_PASSWORD"}
    for var in required:
        assert re.search(rf"^{var}=", example, re.M), var


def _docker_compose() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def test_docker_compose_config(tmp_path):
    cli = _docker_compose()
    if cli is None:
        pytest.skip("docker CLI or its compose plugin is not installed")
    empty = tmp_path / "empty.env"  # ignore a developer's deploy/.env
    empty.write_text("")
    base = [*cli, "--env-file", str(empty), "-f", str(COMPOSE), "config", "--quiet"]
    env = {**os.environ, **ENV}
    ok = subprocess.run(base, capture_output=True, text=True, env=env, timeout=60)
    assert ok.returncode == 0, ok.stderr
    env.pop("REDIS_PASSWORD")
    bad = subprocess.run(base, capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode != 0 and "REDIS_PASSWORD" in bad.stderr


def _assert_acyclic(graph: dict[str, set[str]]) -> None:
    done: set[str] = set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"dependency cycle: {' -> '.join(path + (node,))}"
        if node not in done:
            for dep in graph.get(node, ()):
                visit(dep, path + (node,))
            done.add(node)

    for node in graph:
        visit(node, ())


@pytest.mark.parametrize(
    ("text", "env", "expected"),
    [
        ("${A}", {"A": "1"}, "1"),
        ("${A}", {}, ""),
        ("${A:-d}", {"A": ""}, "d"),
        ("${A-d}", {"A": ""}, ""),
        ("${A-d}", {}, "d"),
        ("$${A}", {"A": "1"}, "${A}"),
        ("x${A:?need A}y", {"A": "1"}, "x1y"),
    ],
)
def test_interpolation_follows_compose(text, env, expected):
    assert interpolate({"k": [text]}, env) == {"k": [expected]}
    with pytest.raises(KeyError, match="need A"):
        interpolate("${A:?need A}", {"A": ""})
