"""policy/weight_ipc.py's protocol on CPU: the shared buffer is faked in-process (real CUDA IPC: tests/gpu)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from policy import weight_ipc
from policy.weight_ipc import IpcHandle, IpcSenderConfig, IpcWeightReceiver, IpcWeightSender


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2, bias=False)


@pytest.fixture
def fake_ipc(monkeypatch):
    """share() remembers the buffer; open_shared() returns that same tensor (one process, no CUDA)."""
    buffers = {}

    def share(tensor):
        buffers["b"] = tensor
        return IpcHandle(0, b"h", tensor.numel(), 0, b"r", 0, b"e", False)

    monkeypatch.setattr(weight_ipc, "share", share)
    monkeypatch.setattr(weight_ipc, "open_shared", lambda h, n: buffers["b"])
    return buffers


def test_versions_flow_and_values_match(fake_ipc):
    model = Tiny()
    sender = IpcWeightSender(IpcSenderConfig(dtype=""))
    address = sender.start()
    receiver = IpcWeightReceiver("gen-a", address)
    assert receiver.take() is None  # registered, nothing synced yet
    report = sender.sync(model, version=1)
    assert report.sent_to == ["gen-a"] and report.num_bytes >= sum(p.numel() * 4 for p in model.parameters())
    got = receiver.take()
    assert got.version == 1
    tensors = dict(got.named_tensors())
    assert set(tensors) == {"a.weight", "a.bias", "b.weight"}
    torch.testing.assert_close(tensors["a.weight"], model.a.weight.detach())
    receiver.mark_served(1)
    assert sender.members() == {"gen-a": 1}
    assert receiver.take() is None  # nothing newer
    with torch.no_grad():
        model.b.weight.add_(1.0)
    sender.sync(model, version=2)
    got = receiver.take()
    torch.testing.assert_close(dict(got.named_tensors())["b.weight"], model.b.weight.detach())
    receiver.mark_served(2)
    receiver.close()
    sender.close()


def test_learner_waits_for_a_reader_and_drops_a_stuck_one(fake_ipc):
    model = Tiny()
    sender = IpcWeightSender(IpcSenderConfig(dtype="", lock_timeout_s=0.3))
    receiver = IpcWeightReceiver("gen-a", sender.start())
    receiver.take()
    sender.sync(model, version=1)
    held = receiver.take()
    assert held is not None
    release = threading.Timer(0.1, receiver.mark_served, args=(1,))
    release.start()
    report = sender.sync(model, version=2)  # waits ~0.1 s for the reader, then writes
    assert report.sent_to == ["gen-a"] and report.lock_wait_seconds >= 0.05
    held = receiver.take()
    report = sender.sync(model, version=3)  # the reader never releases: dropped after the timeout
    assert report.dropped == ["gen-a"]
    receiver.mark_served(2)  # finds itself dropped: registers again on the next take ...
    assert receiver.take().version == 3  # ... and gets the newest version
    receiver.mark_served(3)
    assert sender.members()["gen-a"] == 3


def test_failed_apply_is_not_retried_and_callback_mode(fake_ipc):
    model = Tiny()
    sender = IpcWeightSender(IpcSenderConfig(dtype="bfloat16"))
    address = sender.start()
    applied = []

    def apply(pairs, version):
        pairs = list(pairs)
        assert all(t.dtype == torch.bfloat16 for _, t in pairs)
        applied.append(version)

    receiver = IpcWeightReceiver("gen-b", address, apply=apply, poll_s=0.001).start()
    sender.sync(model, version=5)
    assert receiver.wait_for(5, timeout_s=5.0) and applied == [5]
    receiver.close()
    failing = IpcWeightReceiver("gen-c", address)
    got = failing.take()
    assert got.version == 5
    failing.mark_served(-1)  # the engine refused it
    assert failing.take() is None and failing.version == -1
    sender.close()


def test_a_vanished_learner_is_not_an_error(fake_ipc):
    import gc

    model = Tiny()
    sender = IpcWeightSender(IpcSenderConfig(dtype=""))
    receiver = IpcWeightReceiver("gen-d", sender.start())
    sender.sync(model, version=1)
    got = receiver.take()
    receiver.mark_served(got.version)
    sender.close()  # drops the store: the learner process is gone
    del sender
    gc.collect()
    assert receiver.take() is None
    assert receiver.stats.failures == 1 and receiver.version == 1
