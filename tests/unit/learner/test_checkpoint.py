"""Checkpoint round trip (model, AdamW, scheduler, trainer state) and the Hugging Face export."""

import json

import pytest
import torch
from transformers.video_processing_utils import BaseVideoProcessor

from learner.checkpoint import Checkpointer, TrainerState, export_hf
from learner.config import OptimConfig, ParallelConfig
from learner.parallel import apply_parallelism, build_optimizer
from policy.loading import load_model, load_processor


def _trained(model_dir, steps=1, seed=0):
    torch.manual_seed(seed)
    hf = load_model(model_dir).train()
    root = apply_parallelism(hf, ParallelConfig(activation_checkpointing=False), torch.device("cpu"))
    opt, sched = build_optimizer(root, OptimConfig(lr=1e-3, warmup_steps=3))
    for _ in range(steps):
        _step(root, opt, sched)
    return root, opt, sched


def _step(root, opt, sched):
    ids = torch.arange(3, 40).unsqueeze(0)
    loss = root.model(input_ids=ids).logits.float().pow(2).mean()
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _params(root):
    return {k: v.detach().clone() for k, v in root.state_dict().items()}


def test_round_trip_restores_training_exactly(tiny_model_dir, tmp_path):
    root, opt, sched = _trained(tiny_model_dir, steps=2)
    ckpt = Checkpointer(tmp_path / "ckpt", keep=2)
    state = TrainerState(step=2, version=2, cursor={"epoch": 0, "index": 5}, consumed=["g1", "g2"])
    path = ckpt.save(root, opt, sched, state)
    assert ckpt.latest() == path and not list((tmp_path / "ckpt").glob("*.tmp"))
    _step(root, opt, sched)
    expected = _params(root)

    root2, opt2, sched2 = _trained(tiny_model_dir, steps=0, seed=1)
    loaded = ckpt.load(path, root2, opt2, sched2)
    assert loaded == state
    assert sched2.last_epoch == sched.last_epoch - 1
    _step(root2, opt2, sched2)
    got = _params(root2)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=0, atol=1e-7)


def test_keeps_newest_and_ignores_partial(tiny_model_dir, tmp_path):
    root, opt, sched = _trained(tiny_model_dir, steps=0)
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3):
        ckpt.save(root, opt, sched, TrainerState(step=step))
    (tmp_path / "step-00000009.tmp").mkdir()  # a save that died half-way
    assert sorted(p.name for p in tmp_path.glob("step-*") if not p.name.endswith(".tmp")) == [
        "step-00000002",
        "step-00000003",
    ]
    assert ckpt.latest().name == "step-00000003"
    state = json.loads((ckpt.latest() / "trainer_state.json").read_text())
    assert state["step"] == 3


def test_export_loads_in_transformers_with_trained_weights(tiny_model_dir, tmp_path):
    root, opt, sched = _trained(tiny_model_dir, steps=1)
    out = export_hf(root, root.model, load_processor(tiny_model_dir), tmp_path / "hf")
    reloaded = load_model(out)
    mine = root.model.state_dict()
    theirs = reloaded.state_dict()
    assert set(mine) == set(theirs)
    for k in mine:
        torch.testing.assert_close(theirs[k], mine[k], rtol=0, atol=0)
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "processor_config.json").is_file() and (out / "preprocessor_config.json").is_file()
    BaseVideoProcessor.get_video_processor_dict(str(out))  # loads where torchvision is installed
    base = load_model(tiny_model_dir).state_dict()
    assert any(not torch.equal(base[k], mine[k]) for k in mine)
    load_processor(out)  # the processor round-trips too


def test_unserialisable_state_is_a_clear_error(tiny_model_dir, tmp_path):
    root, opt, sched = _trained(tiny_model_dir, steps=0)
    with pytest.raises(TypeError, match="cannot store"):
        Checkpointer(tmp_path).save(root, opt, sched, TrainerState(extra={"x": object()}))
