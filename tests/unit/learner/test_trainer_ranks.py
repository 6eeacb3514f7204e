"""`python -m learner --nproc 2` (two gloo ranks, FSDP2) makes the same update as one process."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import broker
from broker.channel import Publisher
from broker.config import BrokerConfig
from broker.images import ImageStore
from broker.names import Names
from learner.config import LearnerConfig
from learner.trainer import Learner
from learner.wiring import NullSender
from tests.unit.learner.groups import make_group
from weights.config import WeightSenderConfig

ROOT = Path(__file__).resolve().parents[3]


def _publish(url, namespace, processor):
    names = Names(namespace)
    t = broker.connect(url)
    pub, store = Publisher(t, names.scored), ImageStore(t, names)
    # Three groups, one text-only: with 2 ranks and a small token budget the ranks get different
    # numbers of micro-batches (one runs a dummy) and one rank sees no image in some micro-batch.
    for seed, image in ((1, True), (2, False), (3, True)):
        pub.publish(
            make_group(processor, store, [1.0, 0.0, 0.5], seed=seed, image=image, group_id=f"g{seed}")
        )
    t.close()


@pytest.mark.slow  # three learner processes start (torchrun + 2 ranks): 15-60 s on 2 shared cores
def test_two_ranks_match_one_process(tiny_model_dir, tiny_processor, redis_server, tmp_path):
    common = [
        "--model",
        str(tiny_model_dir),
        "--broker.url",
        redis_server.url,
        "--weight-sync.no-enabled",
        "--max-steps",
        "1",
        "--idle-exit-s",
        "5",
        "--algo.groups-per-step",
        "3",
        "--batching.max-tokens-per-microbatch",
        "64",
        "--optim.lr",
        "1e-4",
        "--checkpoint.every",
        "0",
    ]
    _publish(redis_server.url, "ranks-two", tiny_processor)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "learner",
            "--nproc",
            "2",
            "--broker.namespace",
            "ranks-two",
            "--run-dir",
            str(tmp_path / "two"),
            *common,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]

    _publish(redis_server.url, "ranks-one", tiny_processor)
    cfg = LearnerConfig(
        model=str(tiny_model_dir),
        broker=BrokerConfig(url=redis_server.url, namespace="ranks-one"),
        run_dir=str(tmp_path / "one"),
        max_steps=1,
        weight_sync=WeightSenderConfig(enabled=False),
        idle_exit_s=5.0,
    )
    cfg.algo.groups_per_step = 3
    cfg.batching.max_tokens_per_microbatch = 64
    cfg.optim.lr = 1e-4
    cfg.checkpoint.every = 0
    learner = Learner(cfg, sender=NullSender())
    learner.train()
    learner.close()

    one = load_file(str(tmp_path / "one" / "hf" / "model.safetensors"))
    two = load_file(str(tmp_path / "two" / "hf" / "model.safetensors"))
    base = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    assert set(one) == set(two) == set(base)
    worst = max((one[k] - two[k]).abs().max().item() for k in one)
    assert worst < 1e-5, worst
    assert any(not torch.equal(one[k], base[k]) for k in one if k.startswith("visual."))
