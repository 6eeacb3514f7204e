"""WeightLoader (weights/vllm_apply.py) without vLLM: validation before any write, rollback after a
load that fails half way."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from weights.vllm_apply import WeightLoader, WeightLoadError, WeightsRolledBack, as_version, checkpoint_shapes


class FakeModel:
    """What the loader reaches inside vLLM's worker: model_runner.reload_weights / model.load_weights."""

    def __init__(self, disk: dict[str, torch.Tensor]):
        self.disk = disk
        self.params = {k: v.clone() for k, v in disk.items()}
        self.fail_after: int | None = None

    def load_weights(self, weights):
        for i, (name, tensor) in enumerate(weights):
            if self.fail_after is not None and i == self.fail_after:
                self.fail_after = None
                raise RuntimeError("boom half way")
            self.params[name].copy_(tensor)

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        assert is_checkpoint_format
        self.load_weights(weights_iterator if weights_iterator is not None else iter(self.disk.items()))


class FakeLLM:
    def __init__(self, model: FakeModel):
        self.worker = type("Worker", (), {})()
        self.worker.model_runner = model
        model.model = model

    def collective_rpc(self, fn, args=(), kwargs=None):
        return [fn(self.worker, *args, **(kwargs or {}))]


@pytest.fixture
def checkpoint(tmp_path):
    disk = {"a.weight": torch.zeros(2, 3), "b.weight": torch.ones(4), "c.weight": torch.full((3,), 2.0)}
    save_file(disk, str(tmp_path / "model.safetensors"))
    return tmp_path, disk


def test_shapes_come_from_the_safetensors_header(checkpoint, tmp_path_factory):
    path, disk = checkpoint
    assert checkpoint_shapes(path) == {k: tuple(v.shape) for k, v in disk.items()}
    with pytest.raises(FileNotFoundError):
        checkpoint_shapes(tmp_path_factory.mktemp("empty"))


@pytest.mark.parametrize("method", ["reload", "load_weights"])
def test_validation_refuses_before_writing(checkpoint, method):
    path, disk = checkpoint
    model = FakeModel(disk)
    loader = WeightLoader(path, method=method, in_process=True, keep_rollback_copy=True)
    llm = FakeLLM(model)
    for bad, match in [
        ([("a.weight", torch.zeros(3, 2))], "shape"),
        ([("zzz", torch.zeros(1))], "not a tensor"),
        ([("b.weight", torch.ones(4, dtype=torch.int64))], "dtype"),
    ]:
        with pytest.raises(WeightLoadError, match=match):
            loader.apply(llm, as_version([("c.weight", torch.full((3,), 9.0)), *bad], 1))
    with pytest.raises(WeightLoadError, match="empty"):
        loader.apply(llm, as_version([], 1))
    assert torch.equal(model.params["c.weight"], disk["c.weight"])  # nothing written
    assert loader.apply(llm, as_version([("a.weight", torch.full((2, 3), 5.0))], 1)) == 1
    assert torch.equal(model.params["a.weight"], torch.full((2, 3), 5.0))


def test_a_load_failing_half_way_is_rolled_back_to_the_last_good_weights(checkpoint):
    path, disk = checkpoint
    model = FakeModel(disk)
    llm = FakeLLM(model)
    loader = WeightLoader(path, method="reload", in_process=True, keep_rollback_copy=True)
    loader.apply(llm, as_version([("a.weight", torch.full((2, 3), 5.0))], 1))  # version 1: a partial update
    good = {k: v.clone() for k, v in model.params.items()}
    model.fail_after = 2
    update = [
        ("b.weight", torch.full((4,), 7.0)),
        ("c.weight", torch.full((3,), 7.0)),
        ("a.weight", torch.ones(2, 3)),
    ]
    with pytest.raises(WeightsRolledBack, match="boom"):
        loader.apply(llm, as_version(update, 1))
    for name in good:  # b and c had been overwritten; the rollback restored them and kept version 1's a
        assert torch.equal(model.params[name], good[name]), name


def test_the_multi_process_path_ships_safetensors_bytes(checkpoint):
    path, disk = checkpoint
    model = FakeModel(disk)
    model.parameters = lambda: iter([torch.zeros(1)])
    loader = WeightLoader(path, method="load_weights", in_process=False, keep_rollback_copy=False)
    loader.apply(FakeLLM(model), as_version([("b.weight", torch.full((4,), 3.0, dtype=torch.bfloat16))], 1))
    assert torch.equal(model.params["b.weight"], torch.full((4,), 3.0))
