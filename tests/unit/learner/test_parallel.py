"""FSDP2 over two CPU (gloo) processes gives the same update as one plain process; its
checkpoint round trip restores every shard of the weights and of the optimizer."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("fsdp_worker.py")


def _run(args, out, *extra):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        args + [str(out), *map(str, extra)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_file(str(out))


@pytest.fixture(scope="module")
def updates(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    one = _run([sys.executable, str(WORKER), str(tiny_model_dir)], tmp / "one.safetensors")
    two = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(WORKER),
            str(tiny_model_dir),
        ],
        tmp / "two.safetensors",
        tmp / "ckpt",
    )
    return one, two


def test_two_rank_fsdp_update_equals_one_process(updates, tiny_model_dir):
    one, two = updates
    assert set(one) == set(two)
    assert one["__grad_norm__"].item() == pytest.approx(two["__grad_norm__"].item(), rel=1e-5)
    worst = max((one[k] - two[k]).abs().max().item() for k in one if not k.startswith("__"))
    assert worst < 1e-5, worst


def test_update_touched_vision_and_text_weights(updates, tiny_model_dir):
    one, two = updates
    base = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    vis = "visual.blocks.0.attn.qkv.weight"
    assert not torch.equal(two["model." + vis], base[vis])  # image sample trained the vision tower
    assert not torch.equal(two["lm_head.weight"], base["lm_head.weight"])


def test_two_rank_checkpoint_round_trip_restores_every_shard(updates):
    _one, two = updates
    assert two["__restored_ok__"].item() == 1.0
