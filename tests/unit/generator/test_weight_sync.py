"""The generator follows the weight-sync kind the learner publishes (generator/weight_sync.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from generator.weight_sync import FollowingReceiver, ipc_address, split_address, start_receiver


class FakeReceiver:
    def __init__(self, kind, host_port, resolve, version):
        self.kind, self.host_port, self.resolve, self.version = kind, host_port, resolve, version
        self.closed = False
        self.served = []
        self.mailbox = None
        self.stats = SimpleNamespace(kind=kind)

    def take(self):
        got, self.mailbox = self.mailbox, None
        return got

    def mark_served(self, version):
        self.served.append(version)

    def close(self):
        self.closed = True


def following(published: dict, version=0):
    made = []

    def make(kind, host_port, resolve, version):
        made.append(FakeReceiver(kind, host_port, resolve, version))
        return made[-1]

    return FollowingReceiver(lambda: published.get("address"), make, version), made


def test_addresses_name_their_kind():
    assert split_address("10.0.0.5:29600") == ("broadcast", "10.0.0.5:29600")
    assert split_address(ipc_address("127.0.0.1:4000")) == ("ipc", "127.0.0.1:4000")
    with pytest.raises(ValueError, match="unknown weight-sync address scheme"):
        split_address("zmq://127.0.0.1:4000")


def test_none_means_no_receiver():
    assert start_receiver("gen-0", "none", None, device="cpu", version=0, timeout_s=1.0) is None


def test_nothing_is_built_before_the_learner_publishes():
    published = {}
    receiver, made = following(published)
    assert receiver.take() is None and made == [] and receiver.kind is None
    receiver.close()  # closing before any learner appeared is fine


def test_the_published_kind_is_built_and_rebuilt_when_the_learner_switches():
    published = {"address": "10.0.0.5:29600"}
    receiver, made = following(published, version=3)
    assert receiver.take() is None
    assert [(r.kind, r.version) for r in made] == [("broadcast", 3)]
    assert made[0].resolve() == "10.0.0.5:29600"
    made[0].mailbox = "v4"
    assert receiver.take() == "v4"
    receiver.mark_served(4)
    assert made[0].served == [4] and receiver.stats.kind == "broadcast"
    receiver.take()
    assert len(made) == 1, "the same kind must not rebuild the receiver"

    published["address"] = ipc_address("127.0.0.1:4000")  # a restarted learner, now on CUDA IPC
    assert receiver.take() is None
    assert made[0].closed
    assert [(r.kind, r.version) for r in made] == [("broadcast", 3), ("ipc", 4)]
    assert made[1].resolve() == "127.0.0.1:4000"
    assert made[0].resolve() is None, "a receiver of the old kind must not reach the new learner"
    assert receiver.kind == "ipc"
    receiver.close()
    assert made[1].closed


def test_an_unreadable_or_unknown_address_keeps_the_current_receiver():
    published = {"address": "10.0.0.5:29600"}
    calls = {"fail": False}

    def resolve():
        if calls["fail"]:
            raise ConnectionError("broker down")
        return published["address"]

    made = []
    receiver = FollowingReceiver(resolve, lambda *a: made.append(FakeReceiver(*a)) or made[-1], 0)
    receiver.take()
    calls["fail"] = True
    assert receiver.take() is None and len(made) == 1 and not made[0].closed
    calls["fail"] = False
    published["address"] = "grpc://x:1"
    assert receiver.take() is None and len(made) == 1 and not made[0].closed
    assert made[0].resolve() is None


def test_a_learner_refuses_cuda_ipc_where_it_cannot_work():
    import torch

    from learner.parallel import DistInfo
    from learner.wiring import build_sender

    def learner(transport, device="cpu", world=1):
        cfg = SimpleNamespace(
            weight_sync=True, weight_transport=transport, weight_sync_host="127.0.0.1", sync_timeout_s=1.0
        )
        info = DistInfo(rank=0, world_size=world, local_rank=0, device=torch.device(device))
        return SimpleNamespace(cfg=cfg, info=info, transport=None, names=None)

    with pytest.raises(ValueError, match="needs the learner on a CUDA GPU"):
        build_sender(learner("cuda-ipc"))
    with pytest.raises(ValueError, match="needs a one-rank learner"):
        build_sender(learner("cuda-ipc", device="cuda", world=2))
    with pytest.raises(ValueError, match="'broadcast' or 'cuda-ipc'"):
        build_sender(learner("nccl"))


def test_the_learner_config_names_a_bad_weight_transport():
    from learner.config import LearnerConfig

    cfg = LearnerConfig(weight_transport="nccl-p2p")
    with pytest.raises(ValueError, match="weight_transport must be one of"):
        cfg.validate()
    LearnerConfig(weight_transport="cuda-ipc").validate()
