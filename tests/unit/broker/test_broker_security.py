"""Attacks on the broker from another local process: nobody but the run writes to the run.

Against the real redis-server and the ZeroMQ broker: a wrong or missing password, commands the
password's user may not run, a password on a command line, a ZeroMQ client without credentials and
one sending an oversize frame; forged, foreign-keyed and moved entries (dead-lettered as "auth"),
oversize entries and blobs (refused on publish, dead-lettered unread with a bounded prefix).
"""

from __future__ import annotations

import os
import stat

import msgspec
import pytest
import redis
import zmq

import broker
from broker.auth import MAGIC, open_sealed, seal
from broker.channel import Publisher, Subscriber
from broker.config import BrokerConfig
from broker.redis_server import LocalRedis, write_redis_config
from broker.schemas import PromptRecord
from broker.stream_options import OversizeError
from broker.transport import TransportError
from broker.zmq_broker import BrokerThread
from broker.zmq_transport import endpoint_of

KEY = b"the run's message key"


def prompt(i: int = 0) -> PromptRecord:
    return PromptRecord(prompt_id=f"p{i}", data_source="synthetic", problem="?", ground_truth="1")


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


# ---- Redis: password, ACL, command line -------------------------------------------------------------
def test_redis_refuses_a_wrong_or_missing_password(redis_server):
    wrong = f"redis://:not-{redis_server.password}@127.0.0.1:{redis_server.port}/0"
    for url in (wrong, f"redis://127.0.0.1:{redis_server.port}/0"):
        with pytest.raises(TransportError):
            broker.connect(url, reconnect_s=0)


def test_the_password_user_cannot_reconfigure_wipe_or_stop_the_server(redis_server, names):
    with broker.connect(redis_server.url) as t:
        t.publish(names.prompts, b"work")
        client = t._redis
        for command in (
            ("CONFIG", "SET", "dir", "/tmp"),
            ("FLUSHALL",),
            ("SHUTDOWN", "NOSAVE"),
            ("KEYS", "*"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        assert t.backlog(names.prompts) == 1


def test_no_password_on_the_redis_server_command_line(tmp_path):
    with LocalRedis() as server:  # its settings arrive on stdin
        assert server.password not in cmdline(server.process.pid)
    argv = write_redis_config(tmp_path / "redis.conf", 6399, "pw-in-a-file", data_dir=str(tmp_path))
    assert "pw-in-a-file" not in " ".join(argv)
    assert "pw-in-a-file" in (tmp_path / "redis.conf").read_text()
    assert stat.S_IMODE(os.stat(tmp_path / "redis.conf").st_mode) == 0o600


# ---- ZeroMQ: credentials and frame size -----------------------------------------------------------------
@pytest.mark.parametrize("password", [None, "wrong"])
def test_a_zmq_client_without_the_password_is_refused(zmq_broker, password):
    host = endpoint_of(zmq_broker.url).removeprefix("tcp://")
    url = f"zmq://:{password}@{host}" if password else f"zmq://{host}"
    with pytest.raises(TransportError, match="refused this client's credentials"):
        broker.connect(url, request_timeout_s=0.3, reconnect_s=10)


def test_a_raw_zmq_request_without_credentials_gets_no_answer(zmq_broker, names):
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint_of(zmq_broker.url))
    try:
        raw.send_multipart([msgspec.msgpack.encode([1, "set_value", names.learner_version, b"forged"])])
        assert not raw.poll(1000)
    finally:
        raw.close()
    with broker.connect(zmq_broker.url) as t:
        assert t.get_value(names.learner_version) is None


def test_a_zmq_frame_above_the_cap_disconnects_its_sender(names):
    with BrokerThread(max_frame_bytes=64 * 1024) as server:
        big = broker.connect(server.url, request_timeout_s=0.3, reconnect_s=0, max_blob_bytes=1 << 20)
        try:
            big.put_blob(names.blob("a" * 64), b"x" * 1000)  # small frames are served
            with pytest.raises(TransportError, match="did not answer"):
                big.put_blob(names.blob("b" * 64), b"x" * (128 * 1024))
        finally:
            big.close()
        with broker.connect(server.url) as t:  # the broker still serves everyone else
            assert t.get_blob(names.blob("a" * 64)) == b"x" * 1000
            assert t.get_blob(names.blob("b" * 64)) is None


# ---- authenticated entries ----------------------------------------------------------------------
def test_seal_and_open():
    sealed = seal(KEY, "s", b"\x81body")
    assert sealed.startswith(MAGIC) and bytes(open_sealed(KEY, "s", sealed)) == b"\x81body"
    assert bytes(open_sealed(None, "s", sealed)) == b"\x81body"  # no key: the tag is stripped unchecked
    assert seal(None, "s", b"\x81body") == b"\x81body"
    for key, stream, payload in ((b"other", "s", sealed), (KEY, "t", sealed), (KEY, "s", b"\x81body")):
        with pytest.raises(ValueError):
            open_sealed(key, stream, payload)


def test_forged_foreign_and_moved_entries_are_dead_lettered_as_auth(broker_url, names):
    with (
        broker.connect(broker_url, auth_key=KEY) as run,
        broker.connect(broker_url) as attacker,
        broker.connect(broker_url, auth_key=b"another run's key") as other,
    ):
        sub = Subscriber(run, names.prompts, "generators", "gen-0", expect=PromptRecord)
        Publisher(run, names.prompts).publish(prompt(0))
        Publisher(attacker, names.prompts).publish(prompt(1))  # unsigned
        Publisher(other, names.prompts).publish(prompt(2))  # signed with another key
        moved = seal(KEY, names.rollouts, msgspec.msgpack.encode(prompt(3)))  # signed for another stream
        attacker.publish(names.prompts, moved)
        attacker.publish(names.prompts, MAGIC + b"\0" * 8)  # a tag cut short
        Publisher(run, names.prompts).publish(prompt(4))
        got = sub.poll(count=10, block_s=1.0)
        assert [m.prompt_id for _, m in got] == ["p0", "p4"]
        assert sub.rejected_count("auth") == 4
        dead = run.dead_letters(names.prompts)
        assert len(dead) == 4 and all("tag" in d.reason for d in dead)
        assert run.pending(names.prompts, "generators") == 2


def test_a_subscriber_without_a_key_reads_signed_entries(broker_url, names):
    with broker.connect(broker_url, auth_key=KEY) as run, broker.connect(broker_url) as reader:
        sub = Subscriber(reader, names.prompts, "audit", "a", expect=PromptRecord)
        Publisher(run, names.prompts).publish(prompt(0))
        assert [m.prompt_id for _, m in sub.poll(count=2, block_s=1.0)] == ["p0"]


def test_the_broker_config_gives_every_role_the_key(tmp_path, monkeypatch, redis_server):
    monkeypatch.delenv("PARALLAX_BROKER_AUTH_KEY", raising=False)
    (tmp_path / "key").write_text("from-a-file\n")
    cfg = BrokerConfig(url=redis_server.url, auth_key_file=str(tmp_path / "key"))
    with cfg.connect() as t:
        assert t.auth_key == b"from-a-file"
    monkeypatch.setenv("PARALLAX_BROKER_AUTH_KEY", "from-env")
    assert BrokerConfig(url=redis_server.url).auth_key() == "from-env"


# ---- byte caps --------------------------------------------------------------------------------------
def test_oversize_entries_and_blobs_are_refused_on_publish(broker_url, names):
    with broker.connect(broker_url, max_entry_bytes=4096, max_blob_bytes=8192) as t:
        with pytest.raises(OversizeError, match="above the cap"):
            t.publish(names.prompts, b"x" * 4097)
        with pytest.raises(OversizeError):
            t.put_blob(names.blob("c" * 64), b"x" * 8193)
        assert t.backlog(names.prompts) == 0 and t.get_blob(names.blob("c" * 64)) is None


def test_an_oversize_entry_is_dead_lettered_unread_with_a_bounded_prefix(broker_url, names):
    huge = b"\x81" + os.urandom(3 * 1024 * 1024)
    with (
        broker.connect(broker_url, max_entry_bytes=1 << 20, auth_key=KEY) as run,
        broker.connect(broker_url, max_entry_bytes=8 << 20) as attacker,
    ):
        sub = Subscriber(run, names.prompts, "generators", "gen-0", expect=PromptRecord)
        attacker.publish(names.prompts, huge)
        Publisher(run, names.prompts).publish(prompt(0))
        assert [m.prompt_id for _, m in sub.poll(count=5, block_s=1.0)] == ["p0"]
        assert sub.rejected_count("oversize") == 1
        (dead,) = run.dead_letters(names.prompts)
        assert "oversize" in dead.reason and dead.nbytes == len(huge)
        assert dead.payload == huge[:1024]
