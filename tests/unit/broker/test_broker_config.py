"""broker.config.BrokerConfig: the URL's environment default and where the Redis password comes from."""

from __future__ import annotations

import pytest

from broker.config import PASSWORD_ENV, URL_ENV, BrokerConfig
from runtime.config import from_dict


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    monkeypatch.delenv(URL_ENV, raising=False)
    monkeypatch.delenv(PASSWORD_ENV, raising=False)


def test_the_url_defaults_to_the_environment(monkeypatch):
    assert BrokerConfig().url == "redis://127.0.0.1:6379/0"
    monkeypatch.setenv(URL_ENV, "zmq://10.0.0.2:5555")
    assert BrokerConfig().url == "zmq://10.0.0.2:5555"


def test_the_password_comes_from_the_environment(monkeypatch):
    cfg = BrokerConfig(url="redis://redis:6379/0")
    assert cfg.password() is None and cfg.connect_url() == "redis://redis:6379/0"
    monkeypatch.setenv(PASSWORD_ENV, "p@ss/word")
    assert cfg.password() == "p@ss/word"
    assert cfg.connect_url() == "redis://:p%40ss%2Fword@redis:6379/0"  # quoted: redis-py unquotes it


def test_the_password_comes_from_a_file_before_the_environment(tmp_path, monkeypatch):
    secret = tmp_path / "redis_password"
    secret.write_text("from-file\n")
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    cfg = BrokerConfig(url="redis://user@redis:6379/0", password_file=str(secret))
    assert cfg.connect_url() == "redis://user:from-file@redis:6379/0"


def test_a_password_in_the_url_is_kept_and_a_redacted_one_is_not_used(monkeypatch):
    assert BrokerConfig(url="redis://:inline@h:1/0").connect_url() == "redis://:inline@h:1/0"
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    assert BrokerConfig(url="redis://:***@h:1/0").connect_url() == "redis://:from-env@h:1/0"
    assert BrokerConfig(url="zmq://h:1").connect_url() == "zmq://:from-env@h:1"  # ZeroMQ PLAIN too


def test_validation_names_the_bad_field(tmp_path):
    with pytest.raises(ValueError, match="url 'http://h:1' must start with one of redis://"):
        from_dict(BrokerConfig, {"url": "http://h:1"})
    with pytest.raises(ValueError, match="password_file .*missing does not exist"):
        from_dict(BrokerConfig, {"password_file": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="max_deliveries must be >= 1"):
        from_dict(BrokerConfig, {"max_deliveries": 0})


def test_connect_uses_the_environments_password_and_the_sections_options(redis_server_auth, monkeypatch):
    server = redis_server_auth
    url = f"redis://127.0.0.1:{server.port}/0"
    monkeypatch.setenv(PASSWORD_ENV, server.password)
    cfg = BrokerConfig(url=url, claim_idle_s=12.0, max_deliveries=3)
    with cfg.connect() as transport:
        assert (transport.options.claim_idle_s, transport.options.max_deliveries) == (12.0, 3)
        transport.set_value("k", b"v")  # authenticated
