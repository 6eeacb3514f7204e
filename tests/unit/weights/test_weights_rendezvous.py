"""The rendezvous listens only where it announces, and admits only peers that present the run's token."""

from __future__ import annotations

from pathlib import Path

import pytest
from weights_procs import Net, announced_config, digest, wait_until

import weights
from weights.config import BroadcastTransport, WeightSenderConfig
from weights.manifest import module_loader


def _listening_addresses(port: int) -> list[str]:
    """Local addresses with a socket listening on `port` (from /proc/net/tcp, IPv4)."""
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hex_port = local.split(":")
        if int(hex_port, 16) == port and state == "0A":
            octets = [str(int(address[i : i + 2], 16)) for i in (6, 4, 2, 0)]
            found.append(".".join(octets))
    return found


@pytest.fixture
def sender():
    s = weights.sender(WeightSenderConfig(transport=BroadcastTransport(bucket_mb=0.002), timeout_s=10.0))
    s.start()
    yield s
    s.close()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
def test_the_store_listens_on_the_announced_loopback_address_only(sender):
    host, _, port = sender.announcement.address.rpartition(":")
    assert host == "127.0.0.1"
    assert _listening_addresses(int(port)) == ["127.0.0.1"]  # not 0.0.0.0


def test_a_random_token_is_announced_and_a_configured_one_kept():
    one, two = (weights.sender(WeightSenderConfig()) for _ in range(2))
    fixed = weights.sender(WeightSenderConfig(token="run-secret"))
    try:
        tokens = [s.start().token for s in (one, two, fixed)]
        assert tokens[0] != tokens[1] and len(tokens[0]) >= 24 and tokens[2] == "run-secret"
    finally:
        for s in (one, two, fixed):
            s.close()


def test_a_peer_without_the_token_is_refused_and_gets_nothing(sender):
    model, target = Net(seed=0), Net(seed=5)
    before = digest(target)
    config = announced_config(sender.announcement, retry_s=0.1)
    config.token = "guessed"
    intruder = weights.receiver(config, "intruder", apply=module_loader(target)).start()
    try:
        wait_until(lambda: intruder.stats.refused >= 1, what="the refusal")
        sender.sync(model, 1)
        assert sender.members() == {} and digest(target) == before
        assert "token" in intruder.stats.last_error
    finally:
        intruder.close()


def test_a_peer_of_the_other_transport_is_refused(sender):
    config = announced_config(sender.announcement, retry_s=0.1)
    config.transport = "cuda-ipc"
    other = weights.receiver(config, "other").start()
    try:
        wait_until(lambda: other.stats.refused >= 1, what="the refusal")
        assert "serves broadcast" in other.stats.last_error and sender.members() == {}
    finally:
        other.close()


def test_a_peer_with_the_token_joins_and_receives(sender):
    model, target = Net(seed=0), Net(seed=5)
    config = announced_config(sender.announcement)
    receiver = weights.receiver(config, "gen", apply=module_loader(target)).start()
    try:
        wait_until(lambda: sender.members(), what="the receiver to join")
        assert sender.sync(model, 1).sent_to == ["gen"]
        assert receiver.wait_for(1, timeout_s=10) and digest(target) == digest(model)
    finally:
        receiver.close()
