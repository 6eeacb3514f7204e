"""Weight sync on a GPU machine: gloo carries CUDA buffers through host memory, and a generator on
the learner's own GPU (which NCCL cannot pair with it) is served that way instead of failing."""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
sys.path.insert(0, str(Path(__file__).parents[1] / "unit" / "weights"))

from weights_procs import Net, digest, gpu_generator_main, perturb, read_lines, wait_until  # noqa: E402

import weights  # noqa: E402
from weights.config import BroadcastTransport, WeightSenderConfig  # noqa: E402
from weights.protocol import encode  # noqa: E402


def _run(tmp_path, learner_device: str, generator_device: str) -> None:
    """A CUDA model; the learner packs its buckets on `learner_device` (cuda: NCCL, cpu: gloo)."""
    model = Net(seed=0).cuda()
    cfg = WeightSenderConfig(transport=BroadcastTransport(bucket_mb=0.002), timeout_s=30.0, send_dtype="keep")
    sender = weights.sender(cfg, device=learner_device)
    p = mp.get_context("spawn").Process(
        target=gpu_generator_main, args=(encode(sender.start()), "gen", str(tmp_path), generator_device)
    )
    p.start()
    try:
        wait_until(lambda: sender.members(), timeout_s=60, what="the generator to join")
        expected, out = {}, tmp_path / "gen.jsonl"
        for version in (1, 2):
            report = sender.sync(model, version)
            assert report.sent_to == ["gen"], report
            expected[version] = digest(model)
            perturb(model, 1.0)
            wait_until(lambda v=version: len(read_lines(out)) == v, timeout_s=60, what=f"version {version}")
        lines = read_lines(out)
        assert {line["version"]: line["digest"] for line in lines} == expected
        assert all(line["device"].startswith(generator_device.split(":")[0]) for line in lines)
    finally:
        (tmp_path / "stop").touch()
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
        sender.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_nccl_learner_serves_a_same_gpu_generator_through_gloo(tmp_path, caplog):
    _run(tmp_path, "cuda", "cuda:0")
    assert "shares this learner's GPU" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gloo_carries_cuda_buffers_through_host(tmp_path):
    _run(tmp_path, "cpu", "cuda:0")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_broadcast_reaches_a_generator_on_another_gpu(tmp_path):
    """The split layout's path (learner GPUs 0-5, generators 6-7): NCCL between two GPUs, bit-exact."""
    _run(tmp_path, "cuda", "cuda:1")
