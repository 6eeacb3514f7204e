"""Redis-only parts of the transport: password from the url, clear connection errors, surviving a
killed and restarted redis-server (with AOF)."""

from __future__ import annotations

import pytest

import broker
from broker.redis_server import free_port
from broker.transport import TransportError


def test_password_protected_server(redis_server_auth, names):
    with broker.connect(redis_server_auth.url) as t:
        t.ensure_group(names.rollouts, "g")
        t.publish(names.rollouts, b"secret work")
        assert [d.payload for d in t.consume(names.rollouts, "g", "c", count=1, block_s=0.5)] == [
            b"secret work"
        ]


def test_wrong_password_is_a_transport_error_without_the_password(redis_server_auth):
    url = redis_server_auth.url.replace(redis_server_auth.password, "wrong-pw")
    with pytest.raises(TransportError, match="connect failed") as info:
        broker.connect(url)
    assert "wrong-pw" not in str(info.value)


def test_missing_password_is_a_transport_error(redis_server_auth):
    with pytest.raises(TransportError):
        broker.connect(f"redis://127.0.0.1:{redis_server_auth.port}/0")


def test_unreachable_server_is_a_transport_error():
    with pytest.raises(TransportError, match="connect failed"):
        broker.connect(f"redis://127.0.0.1:{free_port()}/0", reconnect_s=0)


def test_a_transport_error_names_the_url_without_its_password():
    with pytest.raises(TransportError, match="connect failed") as failed:
        broker.connect(f"redis://user:pw-123@127.0.0.1:{free_port()}/0", reconnect_s=0)
    assert "pw-123" not in str(failed.value) and "redis://user:***@127.0.0.1:" in str(failed.value)


def test_unsupported_url_scheme():
    with pytest.raises(ValueError, match="unsupported broker url"):
        broker.connect("http://127.0.0.1:1")


def test_a_dead_producers_unspent_credits_return_after_the_lease(redis_server, names):
    import time

    from broker.transport import BackpressureTimeout

    dead = broker.connect(redis_server.url, max_len=4, credit_lease_s=1.5)
    dead.publish(names.rollouts, b"one")  # reserves all 4 credits, spends 1, then dies holding 3
    live = broker.connect(redis_server.url, max_len=4, credit_lease_s=1.5)
    with pytest.raises(BackpressureTimeout):
        live.publish(names.rollouts, b"two", timeout=0.1)
    time.sleep(1.6)
    live.publish(names.rollouts, b"two", timeout=2)
    assert live.backlog(names.rollouts) == 2
    live.close()
    dead._redis.close()


def test_a_killed_and_restarted_server_with_aof_loses_nothing_and_clients_reconnect(tmp_path, names):
    import threading

    from broker.redis_server import LocalRedis

    server = LocalRedis(data_dir=str(tmp_path)).start()
    try:
        t = broker.connect(server.url, reconnect_s=20)
        t.ensure_group(names.rollouts, "g")
        for i in range(3):
            t.publish(names.rollouts, f"m{i}".encode())
        held = t.consume(names.rollouts, "g", "c", count=2, block_s=0.5)
        t.ack(names.rollouts, "g", [held[0].id])
        server.kill()  # m1 pending on c, m2 not yet delivered
        restart = threading.Timer(0.5, server.start)
        restart.start()
        t.publish(names.rollouts, b"m3")  # waits for the server, then goes through
        restart.join()
        assert t.reconnects >= 1
        assert t.pending(names.rollouts, "g") == 1
        got = t.consume(names.rollouts, "g", "c", count=10, block_s=0.5)
        assert [d.payload for d in got] == [b"m2", b"m3"]
        again = broker.connect(server.url).consume(names.rollouts, "g", "c", count=10, block_s=0.1)
        assert [(d.payload, d.attempts) for d in again] == [(b"m1", 2), (b"m2", 2), (b"m3", 2)]
    finally:
        server.stop()


def test_a_server_that_stays_down_is_a_transport_error_after_reconnect_s(tmp_path, names):
    import time

    from broker.redis_server import LocalRedis

    server = LocalRedis(data_dir=str(tmp_path)).start()
    t = broker.connect(server.url, reconnect_s=1.0)
    server.kill()
    started = time.monotonic()
    with pytest.raises(TransportError, match="attempts"):
        t.get_value(names.learner_version)
    assert 1.0 <= time.monotonic() - started < 5.0


def test_a_stopped_server_costs_the_reconnect_window_not_the_socket_timeout(tmp_path, names):
    """SIGSTOP: the server's sockets stay open and silent. An attempt waits only for what is left of
    `reconnect_s` (redis-py's own retries are off), not for its 60 s socket timeout, eleven times over; a
    server that comes back within the window answers the call."""
    import os
    import signal
    import threading
    import time

    from broker.redis_server import LocalRedis

    server = LocalRedis(data_dir=str(tmp_path)).start()
    try:
        t = broker.connect(server.url, reconnect_s=1.5)
        t.set_value(names.learner_version, b"1")
        os.kill(server.process.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TransportError, match="attempts over 1.5s"):
            t.get_value(names.learner_version)
        assert time.monotonic() - started < 5.0
        resume = threading.Timer(0.5, os.kill, (server.process.pid, signal.SIGCONT))
        os.kill(server.process.pid, signal.SIGSTOP)
        resume.start()
        assert t.get_value(names.learner_version) == b"1"  # within the window: answered
        resume.join()
        t.close()
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


def test_a_broker_at_its_maxmemory_makes_writers_back_off_and_loses_nothing(names):
    import subprocess
    import threading

    import redis

    from broker.redis_server import redis_binary

    port = free_port()
    server = subprocess.Popen([redis_binary(), "--port", str(port), "--save", "", "--appendonly", "no"])
    try:
        admin = redis.Redis(port=port)
        for _ in range(100):
            try:
                admin.ping()
                break
            except redis.exceptions.ConnectionError:
                threading.Event().wait(0.05)
        t = broker.connect(f"redis://127.0.0.1:{port}/0", reconnect_s=30)
        t.ensure_group(names.prompts, "g")
        admin.config_set("maxmemory", 1)  # every write is refused (OOM)
        published = []
        writer = threading.Thread(
            target=lambda: published.extend(t.publish_many(names.prompts, [b"a", b"b"]))
        )
        writer.start()
        writer.join(timeout=0.5)
        assert writer.is_alive() and t.backlog(names.prompts) == 0  # backing off, nothing half-written
        admin.config_set("maxmemory", 0)
        writer.join(timeout=30)
        assert len(published) == 2 and t.reconnects == 1
        assert [d.payload for d in t.consume(names.prompts, "g", "c", count=5, block_s=0.5)] == [b"a", b"b"]
        t.close()
    finally:
        server.kill()
        server.wait()
