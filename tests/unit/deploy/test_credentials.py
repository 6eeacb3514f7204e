"""The launcher's credentials and broker: a password always, handed over in files, never on a command line.

deploy/credentials.py chooses and stores the run's broker password and message key (0600 files in a
0700 directory, kept for --resume); deploy/stages.start_broker starts redis-server or the ZeroMQ broker
with that password, and a role's BrokerConfig pointing at the files connects while anyone else is refused.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import broker
from broker.config import AUTH_KEY_ENV, PASSWORD_ENV, BrokerConfig
from broker.transport import TransportError
from deploy import stages
from deploy.credentials import RunCredentials
from deploy.plan import LaunchConfig, role_configs
from deploy.supervisor import Supervisor
from runtime.private import read_secret


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.delenv(AUTH_KEY_ENV, raising=False)
    return monkeypatch


def test_a_run_draws_its_secrets_and_a_resumed_run_keeps_them(tmp_path, no_env):
    first = RunCredentials.prepare(tmp_path)
    assert mode(first.password_file) == mode(first.key_file) == 0o600 and mode(first.key_file.parent) == 0o700
    assert len(first.password) >= 40 and read_secret(first.key_file) != first.password
    again = RunCredentials.prepare(tmp_path)  # --resume: entries in flight still verify
    assert (again.password, read_secret(again.key_file)) == (first.password, read_secret(first.key_file))
    assert RunCredentials.prepare(tmp_path / "other").password != first.password


def test_a_given_password_wins_over_the_stored_one(tmp_path, no_env):
    RunCredentials.prepare(tmp_path)
    no_env.setenv(PASSWORD_ENV, "from-env")
    no_env.setenv(AUTH_KEY_ENV, "key-from-env")
    creds = RunCredentials.prepare(tmp_path)
    assert creds.password == "from-env" and read_secret(creds.key_file) == "key-from-env"
    (tmp_path / "pw").write_text("from-file\n")
    assert RunCredentials.prepare(tmp_path, str(tmp_path / "pw")).password == "from-file"


def test_role_configs_point_every_role_at_the_files(tmp_path, no_env):
    creds = RunCredentials.prepare(tmp_path)
    configs = role_configs(
        LaunchConfig(),
        tmp_path,
        Path("/m"),
        Path("/d"),
        "redis://127.0.0.1:1/0",
        "ns",
        password_file=str(creds.password_file),
        auth_key_file=str(creds.key_file),
    )
    for cfg in configs.values():
        assert cfg.broker.url == "redis://127.0.0.1:1/0"
        assert cfg.broker.password() == creds.password
        assert cfg.broker.auth_key() == read_secret(creds.key_file)


@pytest.mark.parametrize("kind", ["redis", "zmq"])
def test_the_launchers_broker_admits_only_the_runs_password(tmp_path, no_env, kind, names):
    run_dir = tmp_path / "run"
    creds = RunCredentials.prepare(run_dir)
    sv = Supervisor(run_dir, {"PYTHONPATH": os.getcwd()}, max_restarts=0)
    try:
        url = stages.start_broker(sv, LaunchConfig(broker=kind), creds)
        child = sv.infra.children[0]
        assert creds.password not in " ".join(child.argv)
        with open(f"/proc/{child.popen.pid}/cmdline", "rb") as f:
            assert creds.password.encode() not in f.read()
        if kind == "redis":
            assert mode(run_dir / "redis") == 0o700 and mode(run_dir / "redis" / "redis.conf") == 0o600
        role = BrokerConfig(
            url=url, password_file=str(creds.password_file), auth_key_file=str(creds.key_file)
        )
        with role.connect(reconnect_s=5) as t:
            t.set_value(names.learner_version, b"1")
            assert t.get_value(names.learner_version) == b"1"
        opts = {"request_timeout_s": 0.3, "reconnect_s": 1} if kind == "zmq" else {"reconnect_s": 0}
        with pytest.raises(TransportError):  # no password
            broker.connect(url, **opts)
    finally:
        sv.infra.stop(grace_s=5)
