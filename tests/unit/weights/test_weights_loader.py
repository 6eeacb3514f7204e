"""WeightLoader (weights/vllm_apply.py) without vLLM: validation before any write, rollback after a
load that fails half way."""

from __future__ import annotations

import pytest
import torch
from fake_worker import FakeLLM, FakeModel, ProcessLLM
from safetensors.torch import save_file

from weights.vllm_apply import WeightLoader, WeightLoadError, WeightsRolledBack, as_version, checkpoint_shapes


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
    loader = WeightLoader(path, method="load_weights", in_process=False, keep_rollback_copy=False)
    llm = ProcessLLM(model)
    loader.apply(llm, as_version([("b.weight", torch.full((4,), 3.0, dtype=torch.bfloat16))], 1))
    assert torch.equal(model.params["b.weight"], torch.full((4,), 3.0))
    assert [sorted(chunk) for chunk in llm.chunks] == [["b.weight"]]  # one safetensors blob crossed msgpack


@pytest.fixture
def six(tmp_path):
    disk = {f"t{i}.weight": torch.full((4,), float(i)) for i in range(6)}  # 16 bytes each
    save_file(disk, str(tmp_path / "model.safetensors"))
    return tmp_path, disk


def test_a_version_crosses_to_a_worker_process_in_chunks_under_the_cap(six):
    path, disk = six
    model = FakeModel(disk)
    llm = ProcessLLM(model)
    loader = WeightLoader(
        path, method="reload", in_process=False, keep_rollback_copy=True, rpc_chunk_bytes=40
    )
    learner = {name: torch.full((4,), 10.0 + i) for i, name in enumerate(disk)}
    assert loader.apply(llm, as_version(list(learner.items()), 1)) == 6
    assert len(llm.chunks) == 3  # 2 tensors (32 bytes) per 40-byte chunk
    assert all(sum(chunk.values()) <= 40 for chunk in llm.chunks)
    assert [sorted(chunk) for chunk in llm.chunks] == [list(learner)[i : i + 2] for i in (0, 2, 4)]
    for name, value in learner.items():
        assert torch.equal(model.params[name], value), name


def test_a_failure_in_a_middle_chunk_rolls_the_whole_version_back(six):
    path, disk = six
    model = FakeModel(disk)
    llm = ProcessLLM(model)
    loader = WeightLoader(
        path, method="reload", in_process=False, keep_rollback_copy=True, rpc_chunk_bytes=40
    )
    loader.apply(llm, as_version([(name, torch.full((4,), -1.0)) for name in disk], 1))
    good = {k: v.clone() for k, v in model.params.items()}
    llm.chunks.clear()
    llm.fail_rpc = 1  # chunk 0 (t0, t1) lands, chunk 1 fails after t2 was written
    with pytest.raises(WeightsRolledBack, match="boom"):
        loader.apply(llm, as_version([(name, torch.full((4,), 5.0)) for name in disk], 2))
    assert len(llm.chunks) == 2 + 3  # the failed version's two RPCs, then the rollback copy in 3 chunks
    assert all(sum(chunk.values()) <= 40 for chunk in llm.chunks)
    for name in good:  # t0..t2 had been overwritten: the rollback restored version 1 everywhere
        assert torch.equal(model.params[name], good[name]), name


def test_a_tensor_larger_than_the_cap_travels_alone_and_the_cap_is_checked(six):
    path, disk = six
    loader = WeightLoader(
        path, method="reload", in_process=False, keep_rollback_copy=False, rpc_chunk_bytes=20
    )
    pairs = [("a", torch.zeros(2)), ("b", torch.zeros(8)), ("c", torch.zeros(2)), ("d", torch.zeros(2))]
    assert [[n for n, _ in chunk] for chunk in loader.chunks(pairs)] == [["a"], ["b"], ["c", "d"]]
    for bad in (0, 2**32):
        with pytest.raises(ValueError, match="rpc_chunk_bytes"):
            WeightLoader(
                path, method="reload", in_process=False, keep_rollback_copy=False, rpc_chunk_bytes=bad
            )
