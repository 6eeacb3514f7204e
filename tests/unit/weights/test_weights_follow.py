"""The generator follows the transport the learner announces (weights/follow.py); the shared config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import weights
from weights.config import SENDER_TRANSPORTS, WeightReceiverConfig, WeightSenderConfig
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
    return FollowingReceiver(WeightReceiverConfig(), "gen", resolve=resolve, make=make, version=version), made


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
    cfg = WeightReceiverConfig(transport="cuda-ipc", address="127.0.0.1:1", token="t")
    assert type(weights.receiver(cfg, "gen")).__name__ == "IpcReceiver"
    plain = WeightReceiverConfig(address="127.0.0.1:1")
    assert type(weights.receiver(plain, "gen")).__name__ == "BroadcastReceiver"
    assert isinstance(
        weights.receiver(WeightReceiverConfig(), "gen", resolve=lambda: None), FollowingReceiver
    )
    with pytest.raises(ValueError, match="no resolve"):
        weights.receiver(WeightReceiverConfig(), "gen")
    with pytest.raises(ValueError, match="unknown weight-sync transport 'nccl'"):
        weights.receiver(WeightReceiverConfig(transport="nccl", address="127.0.0.1:1"), "gen")


@pytest.mark.parametrize(
    "cls, data, match",
    [
        (
            WeightSenderConfig,
            {"transport": "nccl-p2p"},
            "transport.type = 'nccl-p2p': expected one of 'broadcast'",
        ),
        (
            WeightReceiverConfig,
            {"transport": "nccl-p2p"},
            "transport = 'nccl-p2p': expected one of 'broadcast'",
        ),
        (WeightSenderConfig, {"send_dtype": "int3"}, "send_dtype"),
        (WeightSenderConfig, {"layout": "megatron"}, "layout"),
        (WeightReceiverConfig, {"address": "nohost"}, "host:port"),
        (WeightReceiverConfig, {"address": "host:port"}, "port number"),
        (WeightSenderConfig, {"port": 70000}, "port"),
        (WeightSenderConfig, {"transport": {"bucket_mb": 0.0}}, "transport: bucket_mb"),
        (WeightSenderConfig, {"transport": {"type": "cuda-ipc", "lock_timeout_s": 0.0}}, "lock_timeout_s"),
        (WeightSenderConfig, {"timeout_s": 0.0}, "timeout_s"),
        (WeightReceiverConfig, {"retry_s": 0.0}, "retry_s"),
        (WeightSenderConfig, {"host": ""}, "host"),
        (
            WeightSenderConfig,
            {"transport": {"type": "cuda-ipc", "bucket_mb": 64.0}},
            r"\[transport\] \['bucket_mb'\]",
        ),
        (WeightSenderConfig, {"address": "h:1"}, "unknown config keys"),  # a generator's setting
    ],
)
def test_bad_settings_are_named(cls, data, match):
    from runtime.config import from_dict

    with pytest.raises(ValueError, match=match):
        from_dict(cls, data)


def test_both_roles_read_the_section_from_toml_and_flags(tmp_path):
    from generator.config import GeneratorConfig
    from learner.config import LearnerConfig
    from runtime.config import load_config

    toml = tmp_path / "c.toml"
    toml.write_text('[weight_sync]\ntransport = "cuda-ipc"\n')  # the same line reads on either side
    assert load_config(LearnerConfig, ["--config", str(toml)]).weight_sync.transport.type == "cuda-ipc"
    assert load_config(GeneratorConfig, ["--config", str(toml)]).weight_sync.transport == "cuda-ipc"
    toml.write_text('[weight_sync]\nsend_dtype = "bfloat16"\n[weight_sync.transport]\nbucket_mb = 64.0\n')
    cfg = load_config(LearnerConfig, ["--config", str(toml), "--weight-sync.transport.no-checksums"])
    assert (cfg.weight_sync.send_dtype, cfg.weight_sync.transport) == (
        "bfloat16",
        SENDER_TRANSPORTS["broadcast"](bucket_mb=64.0, checksums=False),
    )
    flags = ["--weight-sync.transport.type", "cuda-ipc", "--weight-sync.transport.no-params-in-buffer"]
    cfg = load_config(LearnerConfig, ["--config", str(toml), *flags])
    assert cfg.weight_sync.transport == SENDER_TRANSPORTS["cuda-ipc"](params_in_buffer=False)
    cfg = load_config(
        GeneratorConfig, ["--weight-sync.address", "h:1", "--weight-sync.transport", "cuda-ipc"]
    )
    assert (cfg.weight_sync.address, cfg.weight_sync.transport) == ("h:1", "cuda-ipc")
    from runtime.config import from_dict

    with pytest.raises(ValueError, match="weight_sync.transport.type = 'nccl-p2p': expected one of"):
        from_dict(LearnerConfig, {"weight_sync": {"transport": "nccl-p2p"}})


def test_a_learner_refuses_cuda_ipc_where_it_cannot_work():
    import torch

    from learner.parallel import DistInfo
    from learner.wiring import build_sender

    def build(transport, device="cpu", world=1):
        cfg = WeightSenderConfig(transport=SENDER_TRANSPORTS[transport](), timeout_s=1.0)
        info = DistInfo(rank=0, world_size=world, local_rank=0, device=torch.device(device))
        return build_sender(cfg, info, transport=None, names=None)

    with pytest.raises(ValueError, match="needs the learner on a CUDA GPU"):
        build("cuda-ipc")
    with pytest.raises(ValueError, match="needs a one-rank learner"):
        build("cuda-ipc", device="cuda", world=2)
