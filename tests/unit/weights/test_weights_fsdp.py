"""Weight sync from an FSDP2-sharded learner (two gloo ranks): full tensors are gathered bucket by
bucket on every rank, rank 0 sends them under checkpoint names, and they arrive bit for bit."""

from __future__ import annotations

import multiprocessing as mp
import socket

from weights_procs import digest, file_resolver, fsdp_learner_main, perturb

import weights
from policy.loading import load_model
from weights.config import WeightReceiverConfig
from weights.manifest import module_loader


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_sharded_learner_sends_full_tensors_bit_exact(tiny_model_dir, tmp_path):
    address_file = tmp_path / "address"
    expected = load_model(tiny_model_dir)
    perturb(expected, 0.25)
    target = load_model(tiny_model_dir)
    receiver = weights.receiver(
        WeightReceiverConfig(timeout_s=20.0, retry_s=0.2),
        "gen",
        apply=module_loader(target),
        resolve=file_resolver(address_file),
    ).start()
    ctx = mp.get_context("spawn")
    port = _free_port()
    args = [(r, port, str(tiny_model_dir), str(address_file)) for r in range(2)]
    ranks = [ctx.Process(target=fsdp_learner_main, args=a, daemon=True) for a in args]
    try:
        for p in ranks:
            p.start()
        assert receiver.wait_for(1, timeout_s=90), receiver.stats
        for p in ranks:
            p.join(timeout=60)
        assert [p.exitcode for p in ranks] == [0, 0]
        assert digest(target) == digest(expected)
    finally:
        receiver.close()
        for p in ranks:
            if p.is_alive():
                p.kill()
