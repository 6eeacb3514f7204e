"""cuda-ipc weight sync between two processes on one GPU (weights/ipc_*.py): exact values arrive."""

from __future__ import annotations

import datetime
import multiprocessing as mp

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _model(seed: int):
    from policy.builder import build_model

    return build_model("tiny-fullvocab", "cuda", torch.bfloat16, seed=seed)


def _generator(announcement: bytes, port: int) -> None:
    from torch.distributed import TCPStore

    import weights
    from weights.config import WeightReceiverConfig
    from weights.manifest import module_loader
    from weights.protocol import Announcement, decode

    ctl = TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=120), wait_for_workers=False)
    model = _model(seed=7)
    load = module_loader(model)
    a = decode(announcement, Announcement)
    cfg = WeightReceiverConfig(transport=a.transport, address=a.address, token=a.token, poll_s=0.001)
    receiver = weights.receiver(cfg, "gpu-test", device="cuda").start()
    while not receiver.wait_for(2, timeout_s=0.0):
        got = receiver.poll()
        if got is not None:
            load(got.named_tensors(), got.version)
            receiver.mark_served(got.version)
    sums = [float(p.double().sum()) for p in model.parameters()]
    ctl.set("sums", ",".join(repr(s) for s in sums))
    receiver.close()


def test_two_processes_share_the_weights():
    from torch.distributed import TCPStore

    import weights
    from weights.config import CudaIpcTransport, WeightSenderConfig
    from weights.protocol import encode

    model = _model(seed=1)
    sender = weights.sender(
        WeightSenderConfig(transport=CudaIpcTransport(), send_dtype="bfloat16"), device="cuda"
    )
    address = encode(sender.start())
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
