"""Every deploy/configs/*.toml and every compose command parses into its role's config dataclass.

A shipped TOML names its role on its first line (`# python -m <module> --config ...`); a file
whose module has no registered config class fails, so a new config cannot go untested. Every
value a file writes must reach the parsed config, variant tables (`[loss.policy] type = ...`)
included.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import tomllib
from pathlib import Path

import pytest

from runtime.config import load_config, read_toml
from tests.support.compose import load_compose

ROOT = Path(__file__).resolve().parents[3]
CONFIGS = ROOT / "deploy" / "configs"
PASSWORD = "s3cret-test-pw"
KEY = "message-test-key"
ENV = {"REDIS_PASSWORD": PASSWORD, "PARALLAX_AUTH_KEY": KEY, "GRAFANA_ADMIN_PASSWORD": "admin-test-pw"}
# `python -m <module>` -> its config class
CONFIG_CLASSES = {
    "learner": ("learner.config", "LearnerConfig"),
    "generator": ("generator.config", "GeneratorConfig"),
    "reward_service": ("reward_service.config", "RewardConfig"),
    "deploy": ("deploy.plan", "LaunchConfig"),
}
# compose service -> (module, metrics port)
SERVICES = {
    "learner": ("learner", 9301),
    "generator": ("generator", 9201),
    "reward_service": ("reward_service", 9101),
}


def config_class(module: str) -> type:
    module_name, class_name = CONFIG_CLASSES[module]
    return getattr(importlib.import_module(module_name), class_name)


def role_of(path: Path) -> str:
    """The module named by the file's first line, `# python -m MODULE --config ...`."""
    first = path.read_text().splitlines()[0]
    m = re.match(r"#\s*python -m (\S+) --config (\S+)", first)
    assert m, f"{path.name}: the first line must be `# python -m MODULE --config deploy/configs/{path.name}`"
    assert m[2] == f"deploy/configs/{path.name}", f"{path.name}: the first line names {m[2]}"
    assert m[1] in CONFIG_CLASSES, f"{path.name}: no config class registered for `python -m {m[1]}`"
    return m[1]


def compose_command(service: str, secrets_dir: Path) -> tuple[list[str], dict]:
    """The service's arguments after `python -m <module>` and its environment, with test values; its
    secrets are written to `secrets_dir` as Compose mounts them at /run/secrets/ (the paths replaced)."""
    compose = load_compose(ENV)
    svc = compose["services"][service]
    for name in svc.get("secrets", []):
        (secrets_dir / name).write_text(ENV[compose["secrets"][name]["environment"]])
    command = [a.replace("/run/secrets", str(secrets_dir)) for a in svc["command"]]
    return command[command.index("-m") + 2 :], dict(svc.get("environment") or {})


def test_configs_are_shipped():
    assert len(sorted(CONFIGS.glob("*.toml"))) >= 4


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_shipped_toml_parses_into_its_role_config(path, monkeypatch):
    monkeypatch.delenv("PARALLAX_BROKER_URL", raising=False)
    cls = config_class(role_of(path))
    cfg = load_config(cls, ["--config", str(path)])  # type-checked and validated; SystemExit if not
    assert isinstance(cfg, cls)


def assert_written_values_reached(cfg, data: dict, where: str = "") -> None:
    """Each key of the TOML table `data` is a field of `cfg` holding the written value."""
    for key, value in data.items():
        got = getattr(cfg, key)
        if isinstance(value, dict) and dataclasses.is_dataclass(got):
            assert_written_values_reached(got, value, f"{where}{key}.")
        else:
            want = tuple(value) if isinstance(got, tuple) else value
            assert got == want, f"{where}{key}: the file writes {value!r}, the config holds {got!r}"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.name)
def test_every_value_a_shipped_toml_writes_reaches_the_config(path, monkeypatch):
    monkeypatch.delenv("PARALLAX_BROKER_URL", raising=False)
    cfg = read_toml(config_class(role_of(path)), path)  # as read, before validate() derives any "0 = derived"
    with open(path, "rb") as f:
        assert_written_values_reached(cfg, tomllib.load(f))


def test_the_reference_configs_choose_their_loss_and_transport_by_type():
    learner = load_config(config_class("learner"), ["--config", str(CONFIGS / "learner.toml")])
    assert (learner.loss.policy.type, learner.loss.correction.type) == ("ppo-clip", "decoupled")
    assert learner.weight_sync.transport.type == "broadcast"
    launch = load_config(config_class("deploy"), ["--config", str(CONFIGS / "qwen2_5_vl_7b_geometry3k.toml")])
    assert launch.learner.loss == learner.loss


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_compose_command_parses_into_its_role_config(service, monkeypatch, tmp_path):
    module, port = SERVICES[service]
    args, env = compose_command(service, tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    cfg = load_config(
        config_class(module), [a if not a.startswith("deploy/") else str(ROOT / a) for a in args]
    )
    assert cfg.broker.url == "redis://127.0.0.1:6379/0", "no password on the command line"
    assert cfg.broker.password() == PASSWORD, "the password reaches the process as a secret file"
    assert cfg.broker.connect_url() == f"redis://:{PASSWORD}@127.0.0.1:6379/0"
    assert cfg.broker.auth_key() == KEY, "every role signs and verifies with the run's message key"
    assert PASSWORD not in " ".join(args) and KEY not in " ".join(args)
    assert cfg.broker.namespace == "parallax"
    assert (cfg.metrics.host, cfg.metrics.port) == ("127.0.0.1", port), "host networking: Prometheus is local"
    if module in ("learner", "generator"):
        assert cfg.gpus == {"learner": "0-5", "generator": "6-7"}[module]
        assert cfg.model.startswith("/models/")
    if module == "reward_service":
        assert cfg.workers == 4
    if module == "learner":
        assert cfg.weight_sync.host == "127.0.0.1", "the generators reach the rendezvous on the host"


def test_cpu_roles_read_the_secret_files_over_the_configs_the_launcher_writes(tmp_path):
    """The cpu profile: the `configs` stage writes the role configs (no secret in them), each role adds
    the secret files on its command line."""
    from deploy import role_configs

    runs, secrets = tmp_path / "runs", tmp_path / "secrets"
    secrets.mkdir()
    services = load_compose(ENV)["services"]
    stage = [str(runs) if a == "/runs" else a for a in services["configs"]["command"][3:]]
    assert role_configs.main(stage) == 0
    for path in (runs / "configs").glob("*.toml"):
        assert PASSWORD not in path.read_text() and KEY not in path.read_text(), path.name
    for service, module in (("reward_cpu", "reward_service"), ("generator_cpu", "generator"),
                            ("learner_cpu", "learner")):  # fmt: skip
        args, env = compose_command(service, secrets)
        assert not env.keys() & {"PARALLAX_BROKER_PASSWORD", "PARALLAX_BROKER_AUTH_KEY"}, service
        cfg = load_config(config_class(module), [a.replace("/runs", str(runs), 1) for a in args])
        assert cfg.broker.url == "redis://127.0.0.1:6379/0", service
        assert cfg.broker.password() == PASSWORD and cfg.broker.auth_key() == KEY, service


def test_a_wrong_key_in_a_toml_is_refused(tmp_path):
    bad = tmp_path / "learner.toml"
    bad.write_text('modle = "/models/x"\n')
    with pytest.raises(SystemExit, match="modle"):
        load_config(config_class("learner"), ["--config", str(bad)])
