"""ZeroMQ-only parts: credit leases, publish keys (no credit spent on a repeat, expiry), a broker
that survives bad requests, clear errors."""

from __future__ import annotations

import msgspec
import pytest
import zmq

import broker
from broker.redis_server import free_port
from broker.transport import PUBLISH_KEY_TTL_S, TransportError
from broker.zmq_state import CREDIT_LEASE_S, BrokerState
from broker.zmq_transport import PLAIN_USER, _password_of, endpoint_of


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_credits_are_bounded_by_max_len_and_return_when_the_lease_ends():
    clock = FakeClock()
    state = BrokerState(clock=clock)
    assert state.grant(b"A", "s", want=10, max_len=4)[0] == 4  # all the room there is
    assert state.grant(b"B", "s", want=10, max_len=4)[0] == 0
    assert state.publish(b"B", "s", [b"x"]) is None  # no credit, nothing appended
    assert state.publish(b"A", "s", [b"x"]) == ["1"]
    assert state.grant(b"B", "s", want=10, max_len=4)[0] == 0  # 1 entry + 3 credits held by A
    clock.now += CREDIT_LEASE_S + 1  # A died holding 3 credits
    assert state.grant(b"B", "s", want=10, max_len=4)[0] == 3
    assert state.backlog("s") == 1


def test_acks_free_room_for_credits():
    state = BrokerState(clock=FakeClock())
    state.ensure_group("s", "g")
    state.grant(b"A", "s", want=2, max_len=2)
    state.publish(b"A", "s", [b"a", b"b"])
    assert state.grant(b"A", "s", want=2, max_len=2)[0] == 0
    ids = [i for i, _, _ in state.consume("s", "g", "c", 2, claim_idle_s=30, max_deliveries=3)[0]]
    state.ack("s", "g", ids[:1])
    assert state.grant(b"A", "s", want=2, max_len=2)[0] == 1


def test_a_repeated_publish_key_spends_no_credit_and_is_forgotten_after_its_ttl():
    clock = FakeClock()
    state = BrokerState(clock=clock)
    state.grant(b"A", "s", want=2, max_len=10)
    assert state.publish(b"A", "s", [b"a"], ["k"]) == ["1"]
    assert state.credits_of(b"A", "s")[0] == 1
    assert state.publish(b"A", "s", [b"a", b"b"], ["k", "j"]) == ["1", "2"]  # only "j" needed a credit
    assert state.publish(b"A", "s", [b"a"], ["k"]) == ["1"]  # no credit left, none needed
    assert state.backlog("s") == 2
    clock.now += PUBLISH_KEY_TTL_S + 1
    state.expire()
    assert state.published_keys == {} and state.publish(b"A", "s", [b"a"], ["k"]) is None  # new again


def raw_client(url: str, identity: bytes | None = None) -> zmq.Socket:
    """A bare DEALER socket with the credentials in `url` (ZeroMQ PLAIN)."""
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    if identity:
        raw.setsockopt(zmq.IDENTITY, identity)
    raw.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USER.encode())
    raw.setsockopt(zmq.PLAIN_PASSWORD, _password_of(url).encode())
    raw.connect(endpoint_of(url))
    return raw


def test_broker_survives_garbage_and_unknown_requests(zmq_broker, names):
    raw = raw_client(zmq_broker.url)
    try:
        raw.send(b"\x00garbage")
        raw.send(msgspec.msgpack.encode([7, "no_such_op"]))
        replies = [msgspec.msgpack.decode(raw.recv()) for _ in range(2) if raw.poll(2000)]
    finally:
        raw.close()
    assert [r[1] for r in replies] == ["err", "err"]
    assert replies[1][0] == 7 and "no_such_op" in replies[1][2]
    with broker.connect(zmq_broker.url) as t:  # still serving
        t.set_value(names.learner_version, b"ok")
        assert t.get_value(names.learner_version) == b"ok"


def test_unreachable_broker_is_a_transport_error():
    with pytest.raises(TransportError, match="did not answer"):
        broker.connect(f"zmq://127.0.0.1:{free_port()}", request_timeout_s=0.3, reconnect_s=0)


def test_endpoint_of():
    assert endpoint_of("zmq://10.0.0.1:5555") == "tcp://10.0.0.1:5555"
    assert endpoint_of("zmq://:pw@10.0.0.1:5555") == "tcp://10.0.0.1:5555"
    with pytest.raises(ValueError):
        endpoint_of("redis://x")


def test_broker_process_cli_serves_and_stops(names):
    from broker.zmq_broker import BrokerProcess

    with BrokerProcess() as process:
        with broker.connect(process.url) as t:
            t.ensure_group(names.rollouts, "g")
            t.publish(names.rollouts, b"via the process")
            assert [d.payload for d in t.consume(names.rollouts, "g", "c", block_s=1)] == [b"via the process"]
    assert process.process.returncode is not None


def test_a_resent_request_is_answered_once(zmq_broker, names):
    """A client retry (same request id, same socket identity) does not publish twice."""
    raw = raw_client(zmq_broker.url, identity=b"retrying-client")

    def ask(*request, frames=()):
        raw.send_multipart([msgspec.msgpack.encode(list(request)), *frames])
        assert raw.poll(2000)
        return msgspec.msgpack.decode(raw.recv_multipart()[0])

    try:
        assert ask(1, "credit", names.rollouts, 4, 10, 0.0)[1] == "ok"
        first = ask(2, "publish", names.rollouts, frames=[b"once"])
        again = ask(2, "publish", names.rollouts, frames=[b"once"])  # the reply was "lost": resent
        assert first[1] == "ok" and again[:3] == first[:3]
        assert ask(3, "backlog", names.rollouts)[2] == 1
    finally:
        raw.close()


def test_requests_are_resent_until_the_broker_answers(names):
    """A broker that is down for a moment (here: not started yet) is waited for, within reconnect_s."""
    import threading

    from broker.zmq_broker import BrokerThread

    port = free_port()
    late = BrokerThread(bind=f"tcp://127.0.0.1:{port}", password="pw")
    timer = threading.Timer(1.0, late.start)
    timer.start()
    try:
        with broker.connect(f"zmq://:pw@127.0.0.1:{port}", request_timeout_s=0.3, reconnect_s=20) as t:
            assert t.retries >= 1
            t.set_value(names.learner_version, b"ok")
            assert t.get_value(names.learner_version) == b"ok"
    finally:
        timer.join()
        late.stop()
