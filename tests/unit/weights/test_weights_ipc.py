"""The cuda-ipc transport on CPU: the shared buffer is faked in-process (real CUDA IPC: tests/gpu)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from weights_procs import announced_config, wait_until

import weights
from weights.config import CudaIpcTransport, WeightReceiverConfig, WeightSenderConfig
from weights.ipc_sender import IpcSender


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2, bias=False)


def _pair(generator_id: str, send_dtype: str = "keep", apply=None, **kwargs):
    """A started cuda-ipc sender (`kwargs`: its transport's settings) and a started receiver joined to it."""
    sender = IpcSender(WeightSenderConfig(transport=CudaIpcTransport(**kwargs), send_dtype=send_dtype))
    sender.start()
    config = announced_config(sender.announcement, retry_s=0.05)
    receiver = weights.receiver(config, generator_id, apply=apply).start()
    wait_until(lambda: generator_id in sender.members(), what=f"{generator_id} to join")
    return sender, receiver


def test_versions_flow_and_values_match(fake_ipc):
    model = Tiny()
    sender, receiver = _pair("gen-a")
    assert receiver.poll() is None  # joined, nothing synced yet
    report = sender.sync(model, version=1)
    assert report.sent_to == ["gen-a"] and report.num_bytes >= sum(p.numel() * 4 for p in model.parameters())
    got = receiver.poll()
    assert got.version == 1 and got.ipc is not None
    tensors = dict(got.named_tensors())
    assert set(tensors) == {"a.weight", "a.bias", "b.weight"}
    torch.testing.assert_close(tensors["a.weight"], model.a.weight.detach())
    receiver.mark_served(1)
    assert sender.members() == {"gen-a": 1}
    assert receiver.poll() is None  # nothing newer
    with torch.no_grad():
        model.b.weight.add_(1.0)
    sender.sync(model, version=2)
    got = receiver.poll()
    torch.testing.assert_close(dict(got.named_tensors())["b.weight"], model.b.weight.detach())
    receiver.mark_served(2)
    receiver.close()
    sender.close()


def test_learner_waits_for_a_reader_and_drops_a_stuck_one(fake_ipc):
    model = Tiny()
    sender, receiver = _pair("gen-a", lock_timeout_s=0.3)
    sender.sync(model, version=1)
    held = receiver.poll()
    assert held is not None
    release = threading.Timer(0.1, receiver.mark_served, args=(1,))
    release.start()
    report = sender.sync(model, version=2)  # waits ~0.1 s for the reader, then writes
    assert report.sent_to == ["gen-a"] and report.wait_seconds >= 0.05
    held = receiver.poll()
    report = sender.sync(model, version=3)  # the reader never releases: dropped after the timeout
    assert report.dropped == ["gen-a"] and sender.members() == {}
    receiver.mark_served(2)  # finds itself dropped: joins again ...
    wait_until(lambda: "gen-a" in sender.members(), what="gen-a to rejoin")
    got = wait_until(receiver.poll, what="the current version after the rejoin")
    assert got.version == 3  # ... and gets the newest version
    receiver.mark_served(3)
    assert sender.members()["gen-a"] == 3
    receiver.close()
    sender.close()


def test_failed_apply_is_not_retried_and_callback_mode(fake_ipc):
    model = Tiny()
    applied = []

    def apply(pairs, version):
        pairs = list(pairs)
        assert all(t.dtype == torch.bfloat16 for _, t in pairs)
        applied.append(version)

    sender, receiver = _pair("gen-b", send_dtype="bfloat16", apply=apply)
    sender.sync(model, version=5)
    assert receiver.wait_for(5, timeout_s=5.0) and applied == [5]
    receiver.close()
    failing = weights.receiver(announced_config(sender.announcement), "gen-c").start()  # a late joiner
    wait_until(lambda: "gen-c" in sender.members(), what="gen-c to join")
    got = failing.poll()
    assert got.version == 5
    failing.mark_served(-1)  # the engine refused it
    assert failing.poll() is None and failing.version == -1
    failing.close()
    sender.close()


def test_a_vanished_learner_is_not_an_error(fake_ipc):
    import gc

    model = Tiny()
    sender, receiver = _pair("gen-d")
    sender.sync(model, version=1)
    got = receiver.poll()
    receiver.mark_served(got.version)
    sender.close()  # drops the store: the learner process is gone
    del sender
    gc.collect()
    noticed = lambda: receiver.poll() is None and receiver.stats.failures >= 1  # noqa: E731
    wait_until(noticed, what="the loss to be noticed")
    assert receiver.version == 1
    receiver.close()


def test_a_cuda_ipc_learner_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        weights.sender(WeightSenderConfig(transport=CudaIpcTransport()), device="cpu")


def test_a_learner_that_closes_withdraws_its_announcement_and_is_not_called_again(
    fake_ipc, monkeypatch, caplog
):
    """A learner's normal end: generators log it as such (no warning) and stop calling its rendezvous."""
    import logging

    from weights import ipc_receiver
    from weights.follow import broker_publisher, broker_resolver

    values = {}
    broker = type("Broker", (), {"set_value": values.__setitem__, "get_value": values.get})()
    names = type("Names", (), {"weight_sync_address": "run:weights:address"})()
    sender = IpcSender(
        WeightSenderConfig(transport=CudaIpcTransport()), publish=broker_publisher(broker, names)
    )
    sender.start()
    config = WeightReceiverConfig(retry_s=0.05)
    receiver = weights.receiver(config, "gen-w", resolve=broker_resolver(broker, names)).start()
    wait_until(lambda: "gen-w" in sender.members(), what="gen-w to join")
    calls = []
    real_connect = ipc_receiver.connect
    monkeypatch.setattr(ipc_receiver, "connect", lambda *a, **k: calls.append(a) or real_connect(*a, **k))
    with caplog.at_level(logging.INFO, logger="weights"):
        sender.close()
        assert broker_resolver(broker, names)() is None, "the announcement must be withdrawn"
        wait_until(lambda: receiver.poll() is None and receiver.stats.failures >= 1, what="the end noticed")
        threading.Event().wait(0.5)  # ten retry periods
    assert calls == [], "a withdrawn learner must not be called again"
    said = [r for r in caplog.records if r.name == "weights.ipc_receiver"]
    assert any("closed its weight sync" in r.getMessage() for r in said)
    assert not [r for r in said if r.levelno >= logging.WARNING]
    receiver.close()


def _in_buffer(model, buffer) -> list[bool]:
    base = buffer.untyped_storage().data_ptr()
    return [p.untyped_storage().data_ptr() == base for p in model.parameters()]


def test_parameters_live_in_the_buffer_and_writes_wait_for_readers(fake_ipc):
    model = Tiny()
    sender, receiver = _pair("gen-a")
    assert sender.begin_write() == 0.0  # nothing in the buffer yet: nothing to lock
    sender.sync(model, version=1)
    assert all(_in_buffer(model, fake_ipc["b"]))  # the buffer is the parameters: no second copy
    held = receiver.poll()
    assert held.version == 1
    threading.Timer(0.1, receiver.mark_served, args=(1,)).start()
    assert sender.begin_write() >= 0.05  # the optimizer waits for the reader to finish copying
    assert sender.begin_write() == 0.0  # held until the sync
    with torch.no_grad():
        model.a.weight.add_(1.0)  # the optimizer's write, straight into what generators read
    late = weights.receiver(announced_config(sender.announcement), "gen-late").start()
    wait_until(lambda: "gen-late" in sender.members(), what="gen-late to join")
    assert late.poll() is None  # joined mid-write: locked out of the half-written version 1
    report = sender.sync(model, version=2)
    assert sorted(report.sent_to) == ["gen-a", "gen-late"]
    for r in (receiver, late):
        got = r.poll()
        assert got.version == 2
        torch.testing.assert_close(dict(got.named_tensors())["a.weight"], model.a.weight.detach())
        r.mark_served(2)
    late.close()
    receiver.close()
    sender.close()


def test_parameters_stay_apart_when_asked_or_of_another_dtype(fake_ipc):
    for kwargs in (dict(params_in_buffer=False), dict(send_dtype="bfloat16")):
        model = Tiny()
        sender, receiver = _pair("gen-a", **kwargs)
        sender.sync(model, version=1)
        assert not any(_in_buffer(model, fake_ipc["b"])) and sender.begin_write() == 0.0
        with torch.no_grad():
            model.b.weight.mul_(2.0)
        sender.sync(model, version=2)  # copied into the buffer as before
        got = wait_until(receiver.poll, what="version 2")
        sent = dict(got.named_tensors())["b.weight"].float()
        torch.testing.assert_close(sent, model.b.weight.detach(), rtol=1e-2, atol=1e-2)  # bf16 on the wire
        receiver.mark_served(2)
        receiver.close()
        sender.close()
