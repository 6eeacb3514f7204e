"""deploy/docker-compose.yml: profiles, host networking, the CPU demo's stages and roles, healthchecks,
secret files and consistency with Prometheus and the launcher.

There is no Docker engine here. `docker compose config` (which needs no engine) runs when the
docker CLI and its compose plugin are installed; the structural checks with PyYAML always run.
tests/compose/ runs the cpu profile for real (`./run test-compose`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from deploy import role_configs
from deploy.plan import LaunchConfig, TaskOptions
from deploy.stages import warm_start_args
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
BOTH = {"redis", "redis_exporter", "grafana"}
CPU = {
    "model",
    "task",
    "warmstart",
    "configs",
    "reward_cpu",
    "generator_cpu",
    "learner_cpu",
    "prometheus_cpu",
}
GPU = {"reward_service", "generator", "learner", "prometheus"}
STAGES = ("model", "task", "warmstart", "configs")
CPU_ROLES = {"reward_cpu": ("reward_service", "reward"), "generator_cpu": ("generator", "generator"),
             "learner_cpu": ("learner", "learner")}  # fmt: skip
GPU_ROLES = {
    "reward_service": ("reward", 9101),
    "generator": ("generator", 9201),
    "learner": ("learner", 9301),
}
IMAGES = {
    "REDIS_IMAGE": "redis:7.4.2-alpine",
    "REDIS_EXPORTER_IMAGE": "oliver006/redis_exporter:v1.67.0",
    "PROMETHEUS_IMAGE": "prom/prometheus:v2.55.1",
    "GRAFANA_IMAGE": "grafana/grafana-oss:11.6.0",
}
SECRET_FLAGS = ["--broker.password-file", "/run/secrets/redis_password", "--broker.auth-key-file",
                "/run/secrets/message_key"]  # fmt: skip


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose(raw) -> dict:
    return interpolate(raw, ENV)


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def prometheus_targets(name: str) -> dict[str, set[tuple[str, int]]]:
    """job -> {(host, port)} of deploy/prometheus/<name>."""
    config = yaml.safe_load((DEPLOY / "prometheus" / name).read_text())
    jobs: dict[str, set[tuple[str, int]]] = {}
    for job in config["scrape_configs"]:
        assert "dns_sd_configs" not in job, "container DNS does not resolve under host networking"
        found = jobs.setdefault(job["job_name"], set())
        for sc in job.get("static_configs", []):
            for target in sc["targets"]:
                host, port = target.rsplit(":", 1)
                found.add((host, int(port)))
    return jobs


def test_every_service_is_in_a_profile_on_the_host_network(compose):
    services = compose["services"]
    assert set(services) == BOTH | CPU | GPU
    for name, svc in services.items():
        want = {"cpu", "gpu"} if name in BOTH else {"cpu"} if name in CPU else {"gpu"}
        assert set(svc["profiles"]) == want, name
        assert svc["network_mode"] == "host", f"{name}: only host networking runs under podman here"
        for key in ("ports", "expose", "networks", "hostname"):
            assert key not in svc, f"{name}.{key} means nothing on the host network"


@pytest.mark.parametrize("missing", sorted(ENV))
def test_required_variables_are_required(raw, missing):
    with pytest.raises(KeyError, match=missing):
        interpolate(raw, {k: v for k, v in ENV.items() if k != missing})


def test_third_party_images_are_variables_with_the_public_defaults(raw, compose):
    uses = {
        "REDIS_IMAGE": ["redis"],
        "REDIS_EXPORTER_IMAGE": ["redis_exporter"],
        "GRAFANA_IMAGE": ["grafana"],
        "PROMETHEUS_IMAGE": ["prometheus", "prometheus_cpu"],
    }
    for variable, services in uses.items():
        for name in services:
            assert raw["services"][name]["image"] == f"${{{variable}:-{IMAGES[variable]}}}", name
            assert (
                interpolate(raw, {**ENV, variable: "localhost/x:1"})["services"][name]["image"]
                == "localhost/x:1"
            )
    example = (DEPLOY / "env.example").read_text()
    for variable, default in IMAGES.items():
        assert f"{variable}={default}" in example, variable


def test_cpu_stages_run_what_the_launcher_runs(compose):
    cfg = LaunchConfig()
    services = compose["services"]

    def args(name: str) -> list[str]:
        return services[name]["command"][3:]  # after python -m MODULE

    assert services["model"]["command"][:4] == ["python", "-m", "policy", "build"]
    assert args("model")[1:] == [
        "--preset",
        cfg.preset,
        "--seed",
        str(cfg.model_seed),
        "--out",
        "/runs/model",
    ]
    assert services["task"]["command"][:3] == ["python", "-m", "tasks"]
    assert args("task") == TaskOptions().synthetic_args(Path("/runs/data"))
    assert services["warmstart"]["command"][:3] == ["python", "-m", "learner.warmstart"]
    model, data, out = Path("/runs/model"), Path("/runs/data"), Path("/runs/warmstart/model")
    assert args("warmstart") == warm_start_args(cfg, model, data, out, "cpu")
    for name in STAGES:
        assert services[name]["restart"] == "no" and "runs:/runs" in services[name]["volumes"]
    assert set(services["warmstart"]["depends_on"]) == {"model", "task"}


def test_cpu_roles_run_python_m_role_on_the_configs_the_launcher_writes(compose, tmp_path):
    services = compose["services"]
    for name, (module, _) in CPU_ROLES.items():
        role = "reward" if module == "reward_service" else module
        command = services[name]["command"]
        assert command == ["python", "-m", module, "--config", f"/runs/configs/{role}.toml", *SECRET_FLAGS]
        deps = services[name]["depends_on"]
        assert deps["configs"]["condition"] == "service_completed_successfully", name
        assert deps["redis"]["condition"] == "service_healthy", name
        if module != "reward_service":
            assert deps["warmstart"]["condition"] == "service_completed_successfully", name
    command = services["configs"]["command"]
    assert command[:3] == ["python", "-m", "deploy.role_configs"]
    args = [str(tmp_path) if a == "/runs" else a for a in command[3:]]
    assert role_configs.main(args) == 0
    written = {p.stem: tomllib.loads(p.read_text()) for p in (tmp_path / "configs").glob("*.toml")}
    assert written["learner"]["model"] == written["generator"]["model"] == "/runs/warmstart/model"
    assert written["learner"]["feeder"]["train_data"] == "/runs/data"
    for config in written.values():
        assert config["broker"]["url"] == "redis://127.0.0.1:6379/0" and "password" not in config["broker"]
        assert config["broker"]["namespace"] == "parallax"
    assert written["learner"]["eval"]["stop_accuracy"] == 0.95 and written["learner"]["max_steps"] == 400
    demo = LaunchConfig()  # everything else is the demo's: same optimizer, sampling, reward routes
    assert written["learner"]["optim"]["lr"] == demo.learner.optim.lr
    assert written["generator"]["sampling"]["n"] == demo.generator.sampling.n
    assert written["reward"]["workers"] == demo.reward.workers
    ports = {job: {(written[job]["metrics"]["host"], written[job]["metrics"]["port"])} for job in written}
    targets = prometheus_targets("cpu.yml")
    for job, found in ports.items():
        assert targets[job] == found, f"cpu.yml scrapes {targets[job]}, the {job} serves {found}"
        healthcheck = services[f"{job}_cpu"]["healthcheck"]["test"][1]
        assert f"http://127.0.0.1:{next(iter(found))[1]}/metrics" in healthcheck


def test_gpu_entry_commands_and_disjoint_gpus(compose):
    services = compose["services"]
    cmds = {name: services[name]["command"] for name in GPU_ROLES}
    assert cmds["learner"][:5] == ["python", "-m", "learner", "--gpus", "0-5"]
    assert flag(cmds["learner"], "--config") == "deploy/configs/learner.toml"
    assert cmds["generator"][:5] == ["python", "-m", "generator", "--gpus", "6-7"]
    assert flag(cmds["generator"], "--config") == "deploy/configs/generator.toml"
    assert cmds["reward_service"][:5] == ["python", "-m", "reward_service", "--workers", "4"]
    used = {}
    for name in ("learner", "generator"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
        # --gpus holds host indices: only with every device visible do they mean the same in the container
        assert device.get("count") == "all" and "device_ids" not in device
        assert services[name]["ipc"] == "host", (
            "NCCL weight sync between containers needs the host IPC namespace"
        )
        used[name] = set(parse_gpus(flag(cmds[name], "--gpus")))
    assert used["learner"] == set(range(6)) and used["generator"] == {6, 7}


def test_gpu_metrics_ports_match_prometheus(compose):
    targets = prometheus_targets("prometheus.yml")
    for name, (job, base) in GPU_ROLES.items():
        command = compose["services"][name]["command"]
        assert int(flag(command, "--metrics.port")) == base
        count = int(flag(command, "--workers") or 1) if name == "reward_service" else 1
        count = len(parse_gpus(flag(command, "--gpus"))) if name == "generator" else count
        assert targets[job] == {("127.0.0.1", base + i) for i in range(count)}, job
        assert f"http://127.0.0.1:{base}/metrics" in compose["services"][name]["healthcheck"]["test"][1]


@pytest.mark.parametrize("name", ["prometheus.yml", "cpu.yml"])
def test_prometheus_scrapes_every_job_on_the_host(name):
    targets = prometheus_targets(name)
    assert set(targets) == {"prometheus", "learner", "generator", "reward", "redis"}
    assert targets["redis"] == {("127.0.0.1", 9121)} and targets["prometheus"] == {("127.0.0.1", 9090)}
    assert all(host == "127.0.0.1" for found in targets.values() for host, _ in found)


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
    assert "--port 6379 --bind 127.0.0.1" in script, "its own port, on the host's loopback only"
    assert "REDISCLI_AUTH" not in (redis.get("environment") or {})
    assert "/run/secrets/redis_password" in " ".join(redis["healthcheck"]["test"]), (
        "the healthcheck must authenticate"
    )
    assert "redis_data:/data" in redis["volumes"]
    exporter = compose["services"]["redis_exporter"]["environment"]
    assert exporter["REDIS_PASSWORD"] == ENV["REDIS_PASSWORD"]
    assert exporter["REDIS_ADDR"] == "redis://127.0.0.1:6379"
    assert "parallax:rollouts" in exporter["REDIS_EXPORTER_CHECK_STREAMS"]
    assert compose["secrets"] == {
        "redis_password": {"environment": "REDIS_PASSWORD"},
        "message_key": {"environment": "PARALLAX_AUTH_KEY"},
    }
    for name in (*CPU_ROLES, *GPU_ROLES, *STAGES):
        service = compose["services"][name]
        command = service["command"]
        for secret in (ENV["REDIS_PASSWORD"], ENV["PARALLAX_AUTH_KEY"]):
            assert secret not in " ".join(command), f"{name}: a secret on a command line shows in ps"
            assert secret not in str(service.get("environment")), f"{name}: use the secret file"
        if name in STAGES:  # they write files; none of them talks to Redis
            assert "secrets" not in service, name
            continue
        assert flag(command, "--broker.password-file") == "/run/secrets/redis_password", name
        assert flag(command, "--broker.auth-key-file") == "/run/secrets/message_key", name
        assert set(service["secrets"]) == {"redis_password", "message_key"}, name
        assert "PARALLAX_BROKER_PASSWORD" not in (service.get("environment") or {}), name


def test_the_redis_port_is_one_variable(raw):
    moved = interpolate(raw, {**ENV, "REDIS_PORT": "6390"})["services"]
    assert "--port 6390 --bind 127.0.0.1" in moved["redis"]["command"][0]
    assert "-p 6390" in moved["redis"]["healthcheck"]["test"][1]
    assert moved["redis_exporter"]["environment"]["REDIS_ADDR"] == "redis://127.0.0.1:6390"
    assert flag(moved["configs"]["command"], "--broker-url") == "redis://127.0.0.1:6390/0"
    for name in GPU_ROLES:
        assert flag(moved[name]["command"], "--broker.url") == "redis://127.0.0.1:6390/0", name


@pytest.mark.parametrize("name", ["prometheus", "prometheus_cpu"])
def test_prometheus_cannot_be_stopped_or_reloaded_over_http(compose, name):
    command = compose["services"][name]["command"]
    assert not any("lifecycle" in a for a in command)
    assert "--web.listen-address=127.0.0.1:9090" in command, "the host's loopback only"


def test_no_secret_is_written_in_the_file(raw):
    secrets = 0
    for name, svc in raw["services"].items():
        environment = svc.get("environment") or {}
        for key, value in environment.items() if isinstance(environment, dict) else ():
            if re.search(r"PASSWORD|AUTH|SECRET|TOKEN$", key):
                assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]*\}", str(value)), f"{name}.{key} is hard-coded"
                secrets += 1
    assert secrets >= 2  # redis_exporter, grafana admin
    for name, secret in raw["secrets"].items():
        assert set(secret) == {"environment"}, f"secret {name} must come from deploy/.env"


def test_healthchecks_are_shell_strings_that_parse(compose):
    """CMD-SHELL only: podman's Docker API splits the arguments of a CMD list on spaces."""
    services = compose["services"]
    for name, svc in services.items():
        if name in STAGES or name == "redis_exporter":  # one-shots; a scratch image without a shell
            assert "healthcheck" not in svc, name
            continue
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL" and len(test) == 2, name
        words = shlex.split(test[1])
        if words[0].startswith("REDISCLI_AUTH="):  # the password from its secret file, not from ps
            assert words[0] == "REDISCLI_AUTH=$(cat /run/secrets/redis_password)", name
            words = words[1:]
        if words[0] == "python":
            assert words[1] == "-c" and len(words) == 3, name
            compile(words[2], name, "exec")
        else:
            assert words[0] in ("redis-cli", "wget"), name


def test_dependencies_exist_and_are_acyclic(compose):
    services = compose["services"]
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert set(services[dep]["profiles"]) >= set(svc["profiles"]), (
                f"{name}: {dep} is not in its profiles"
            )
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"
            if cond["condition"] == "service_completed_successfully":
                assert dep in STAGES, f"{name} waits for {dep} to exit"
    _assert_acyclic({n: set(s.get("depends_on") or {}) for n, s in services.items()})


def test_volumes_builds_and_mounts(compose):
    declared = set(compose["volumes"])
    for name, svc in compose["services"].items():
        for spec in svc.get("volumes", []):
            source = spec.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists() or source in ("./models", "./data"), f"{name}: {source}"
            elif not source.startswith(("/", "$")):
                assert source in declared, f"{name}: volume {source} not declared"
        if "build" in svc:
            assert (DEPLOY / svc["build"]["context"]).resolve() == ROOT, name
            assert (ROOT / svc["build"]["dockerfile"]).is_file(), name
    built = {name for name, svc in compose["services"].items() if "build" in svc}
    assert built == {"model", "reward_service", "generator", "learner"}, "one build per image and profile"
    for name in ("prometheus", "prometheus_cpu"):
        prom = compose["services"][name]
        assert "./prometheus:/etc/prometheus:ro" in prom["volumes"]
    assert "--config.file=/etc/prometheus/cpu.yml" in compose["services"]["prometheus_cpu"]["command"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in compose["services"]["prometheus"]["command"]


def test_env_example_lists_every_required_variable():
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
    return ["docker-compose"] if shutil.which("docker-compose") else None


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_docker_compose_config(tmp_path, profile):
    cli = _docker_compose()
    if cli is None:
        pytest.skip("docker CLI or its compose plugin is not installed")
    empty = tmp_path / "empty.env"  # ignore a developer's deploy/.env
    empty.write_text("")
    base = [*cli, "--env-file", str(empty), "-f", str(COMPOSE), "--profile", profile, "config", "--quiet"]
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
