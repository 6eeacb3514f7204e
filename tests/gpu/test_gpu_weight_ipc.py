"""CUDA-IPC weight sync between two processes on one GPU (policy/weight_ipc.py): exact values arrive."""

from __future__ import annotations

import datetime
import multiprocessing as mp

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model(seed: int):
    from policy.builder import build_model

    return build_model("tiny-fullvocab", "cuda", torch.bfloat16, seed=seed)


def _generator(address: str, port: int) -> None:
    from torch.distributed import TCPStore

    from generator.weight_receiver import module_loader
    from policy.weight_ipc import IpcWeightReceiver

    ctl = TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=120), wait_for_workers=False)
    model = _model(seed=7)
    load = module_loader(model)
    receiver = IpcWeightReceiver("gpu-test", address, poll_s=0.001)
    while not receiver.wait_for(2, timeout_s=0.0):
        got = receiver.take()
        if got is not None:
            load(got.named_tensors(), got.version)
            receiver.mark_served(got.version)
    sums = [float(p.double().sum()) for p in model.parameters()]
    ctl.set("sums", ",".join(repr(s) for s in sums))


def test_two_processes_share_the_weights():
    from torch.distributed import TCPStore

    from policy.weight_ipc import IpcSenderConfig, IpcWeightSender

    model = _model(seed=1)
    sender = IpcWeightSender(IpcSenderConfig(dtype="bfloat16"))
    address = sender.start()
    ctl = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=120), wait_for_workers=False)
    child = mp.get_context("spawn").Process(target=_generator, args=(address, ctl.port))
    child.start()
    try:
        sender.sync(model, version=1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.0)
        while not sender.members():
            pass
        sender.sync(model, version=2)
        ctl.wait(["sums"], datetime.timedelta(seconds=120))
        theirs = [float(x) for x in ctl.get("sums").decode().split(",")]
        mine = [float(p.double().sum()) for p in model.parameters()]
        assert theirs == mine
    finally:
        child.join(timeout=60)
        sender.close()
    assert child.exitcode == 0
