"""Verified checkpoints: a manifest written last, a damaged newest checkpoint skipped for the previous one
(naming the file), an older checkpoint without a manifest still loaded, and none usable named in full."""

import json
import logging

import pytest
import torch

from learner.checkpoint import Checkpointer, TrainerState
from learner.manifest import MANIFEST, CorruptCheckpoint, verify
from tests.unit.learner.test_checkpoint import _params, _step, _trained


@pytest.fixture
def saved(tiny_model_dir, tmp_path):
    """Checkpoints of steps 1 and 2 (different weights) and a fresh model to load them into."""
    root, opt, sched = _trained(tiny_model_dir, steps=1)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    ckpt.save(root, opt, sched, TrainerState(step=1, version=1, consumed=["g1"]))
    step1 = _params(root)
    _step(root, opt, sched)
    ckpt.save(root, opt, sched, TrainerState(step=2, version=2, consumed=["g1", "g2"]))
    fresh = _trained(tiny_model_dir, steps=0, seed=1)
    return ckpt, step1, fresh


def test_every_file_is_in_the_manifest_with_its_size_and_sha256(saved):
    ckpt, _, _ = saved
    newest = ckpt.latest()
    files = json.loads((newest / MANIFEST).read_text())["files"]
    assert set(files) == {"model.safetensors", "optim.safetensors", "optim.json", "trainer_state.json"}
    assert files["model.safetensors"]["size"] == (newest / "model.safetensors").stat().st_size
    assert verify(newest) is True and not list(newest.glob("*.tmp"))


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(saved, caplog):
    ckpt, step1, (root, opt, sched) = saved
    weights = ckpt.latest() / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="learner.checkpoint"):
        state = ckpt.resume(root, opt, sched)
    assert state.step == 1 and state.consumed == ["g1"]
    for k, v in _params(root).items():
        torch.testing.assert_close(v, step1[k], rtol=0, atol=0)
    skipped = [
        r.getMessage() for r in caplog.records if "skipping checkpoint step-00000002" in r.getMessage()
    ]
    assert skipped and str(weights) in skipped[0] and "truncated" in skipped[0]
    assert any("previous checkpoint step-00000001" in r.getMessage() for r in caplog.records)


def test_a_changed_byte_is_caught_by_the_sha256(saved):
    ckpt, _, _ = saved
    state_file = ckpt.latest() / "trainer_state.json"
    text = state_file.read_text()
    state_file.write_text(text.replace('"step": 2', '"step": 3'))  # same size, other bytes
    with pytest.raises(CorruptCheckpoint, match="trainer_state.json: sha256 differs"):
        verify(ckpt.latest())


def test_a_checkpoint_without_a_manifest_still_loads_and_says_so(saved, caplog):
    ckpt, _, (root, opt, sched) = saved
    (ckpt.latest() / MANIFEST).unlink()  # as written before checkpoints had one
    with caplog.at_level(logging.WARNING, logger="learner.checkpoint"):
        state = ckpt.resume(root, opt, sched)
    assert state.step == 2
    assert any("step-00000002 has no manifest" in r.getMessage() for r in caplog.records)


def test_no_usable_checkpoint_names_every_damaged_file(saved):
    ckpt, _, (root, opt, sched) = saved
    for path in ckpt.complete():
        (path / "optim.safetensors").unlink()
    with pytest.raises(CorruptCheckpoint) as info:
        ckpt.resume(root, opt, sched)
    message = str(info.value)
    assert "step-00000002/optim.safetensors: missing" in message
    assert "step-00000001/optim.safetensors: missing" in message


def test_no_checkpoint_at_all_is_a_fresh_start(tmp_path, tiny_model_dir):
    root, opt, sched = _trained(tiny_model_dir, steps=0)
    assert Checkpointer(tmp_path / "none").resume(root, opt, sched) is None
