"""The generator follows the transport the learner announces (weights/follow.py); the shared config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import weights
from weights.config import WeightSyncConfig
from weights.follow import FollowingReceiver, broker_publisher, broker_resolver
from weights.protocol import Announcement


class FakeReceiver:
    def __init__(self, transport, resolve, version):
        self.transport, self.resolve, self.version = transport, resolve, version
        self.closed = False
        self.served = []
        self.mailbox = None
        self.stats = SimpleNamespace(transport=transport)

    def poll(self):
        got, self.mailbox = self.mailbox, None
        return got

    def mark_served(self, version):
        self.served.append(version)

    def close(self):
        self.closed = True


def announce(transport: str, address: str) -> Announcement:
    return Announcement(transport=transport, address=address, token="t")


def following(published: dict, version=0, resolve=None):
    made = []

    def make(transport, resolve, version):
        made.append(FakeReceiver(transport, resolve, version))
        return made[-1]

    resolve = resolve or (lambda: published.get("announcement"))
    return FollowingReceiver(WeightSyncConfig(), "gen", resolve=resolve, make=make, version=version), made


def test_the_announcement_round_trips_through_the_broker():
    store = {}
    transport = SimpleNamespace(set_value=store.__setitem__, get_value=store.get)
    names = SimpleNamespace(weight_sync_address="run:weights:address")
    resolve = broker_resolver(transport, names)
    assert resolve() is None
    broker_publisher(transport, names)(announce("cuda-ipc", "127.0.0.1:4000"))
    assert resolve() == announce("cuda-ipc", "127.0.0.1:4000")
    store[names.weight_sync_address] = b"host:port"  # what an old learner published: ignored, not fatal
    assert resolve() is None


def test_nothing_is_built_before_the_learner_announces():
    receiver, made = following({})
    assert receiver.poll() is None and made == [] and receiver.kind is None
    receiver.close()  # closing before any learner appeared is fine


def test_the_announced_transport_is_built_and_rebuilt_when_the_learner_switches():
    published = {"announcement": announce("broadcast", "10.0.0.5:29600")}
    receiver, made = following(published, version=3)
    assert receiver.poll() is None
    assert [(r.transport, r.version) for r in made] == [("broadcast", 3)]
    assert made[0].resolve().address == "10.0.0.5:29600"
    made[0].mailbox = "v4"
    assert receiver.poll() == "v4"
    receiver.mark_served(4)
    assert made[0].served == [4] and receiver.stats.transport == "broadcast"
    receiver.poll()
    assert len(made) == 1, "the same transport must not rebuild the receiver"

    published["announcement"] = announce("cuda-ipc", "127.0.0.1:4000")  # a restarted learner, now on cuda-ipc
    assert receiver.poll() is None
    assert made[0].closed
    assert [(r.transport, r.version) for r in made] == [("broadcast", 3), ("cuda-ipc", 4)]
    assert made[1].resolve().address == "127.0.0.1:4000"
    assert made[0].resolve() is None, "a receiver of the old transport must not reach the new learner"
    assert receiver.kind == "cuda-ipc"
    receiver.close()
    assert made[1].closed


def test_an_unreadable_announcement_keeps_the_current_receiver():
    published = {"announcement": announce("broadcast", "10.0.0.5:29600")}
    calls = {"fail": False}

    def resolve():
        if calls["fail"]:
            raise ConnectionError("broker down")
        return published["announcement"]

    receiver, made = following(published, resolve=resolve)
    receiver.poll()
    calls["fail"] = True
    assert receiver.poll() is None and len(made) == 1 and not made[0].closed


def test_the_factory_builds_a_receiver_of_the_configured_transport_with_an_explicit_address():
    cfg = WeightSyncConfig(transport="cuda-ipc", address="127.0.0.1:1", token="t")
    assert type(weights.receiver(cfg, "gen")).__name__ == "IpcReceiver"
    plain = WeightSyncConfig(address="127.0.0.1:1")
    assert type(weights.receiver(plain, "gen")).__name__ == "BroadcastReceiver"
    assert isinstance(weights.receiver(WeightSyncConfig(), "gen", resolve=lambda: None), FollowingReceiver)
    with pytest.raises(ValueError, match="no resolve"):
        weights.receiver(WeightSyncConfig(), "gen")
    with pytest.raises(ValueError, match="unknown weight-sync transport 'nccl'"):
        weights.receiver(WeightSyncConfig(transport="nccl", address="127.0.0.1:1"), "gen")
    with pytest.raises(ValueError, match="unknown weight-sync transport 'nccl'"):
        weights.sender(WeightSyncConfig(transport="nccl"))


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("transport", "nccl-p2p", "transport = 'nccl-p2p': expected one of 'broadcast', 'cuda-ipc'"),
        ("send_dtype", "int3", "send_dtype"),
        ("layout", "megatron", "layout"),
        ("address", "nohost", "host:port"),
        ("address", "host:port", "port number"),
        ("port", 70000, "port"),
        ("bucket_mb", 0.0, "bucket_mb"),
        ("timeout_s", 0.0, "timeout_s"),
        ("host", "", "host"),
    ],
)
def test_bad_settings_are_named(field, value, match):
    from runtime.config import from_dict

    with pytest.raises(ValueError, match=match):
        from_dict(WeightSyncConfig, {field: value})


def test_both_roles_read_the_section_from_toml_and_flags(tmp_path):
    from generator.config import GeneratorConfig
    from learner.config import LearnerConfig
    from runtime.config import load_config

    toml = tmp_path / "c.toml"
    toml.write_text('[weight_sync]\ntransport = "cuda-ipc"\nbucket_mb = 64.0\n')
    for cls in (LearnerConfig, GeneratorConfig):
        cfg = load_config(cls, ["--config", str(toml), "--weight-sync.send-dtype", "bfloat16"])
        assert (cfg.weight_sync.transport, cfg.weight_sync.bucket_mb) == ("cuda-ipc", 64.0)
        assert cfg.weight_sync.send_dtype == "bfloat16"
    from runtime.config import from_dict

    with pytest.raises(ValueError, match="weight_sync.transport = 'nccl-p2p': expected one of"):
        from_dict(LearnerConfig, {"weight_sync": {"transport": "nccl-p2p"}})


def test_a_learner_refuses_cuda_ipc_where_it_cannot_work():
    import torch

    from learner.parallel import DistInfo
    from learner.wiring import build_sender

    def build(transport, device="cpu", world=1):
        cfg = WeightSyncConfig(transport=transport, timeout_s=1.0)
        info = DistInfo(rank=0, world_size=world, local_rank=0, device=torch.device(device))
        return build_sender(cfg, info, transport=None, names=None)

    with pytest.raises(ValueError, match="needs the learner on a CUDA GPU"):
        build("cuda-ipc")
    with pytest.raises(ValueError, match="needs a one-rank learner"):
        build("cuda-ipc", device="cuda", world=2)
    with pytest.raises(ValueError, match="unknown weight-sync transport 'nccl'"):
        build("nccl")
