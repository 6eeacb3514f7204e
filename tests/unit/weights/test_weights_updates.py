"""Applying received versions, as tensors or cuda-ipc references (weights/vllm_apply.py), without CUDA or
vLLM: the shared buffer is a CPU tensor behind a fake opener, vLLM's worker a fake model."""

from __future__ import annotations

import msgspec
import pytest
import torch
from fake_worker import FakeModel, ProcessLLM, ipc_version, shared

from generator.engine import resolve_in_process
from weights import ipc
from weights.ipc import MappingCache
from weights.manifest import pack_bucket
from weights.protocol import TensorSpec
from weights.vllm_apply import WeightLoader, WeightLoadError, WeightsRolledBack, as_version


@pytest.fixture
def opener(monkeypatch):
    """The worker's mapping cache, opening fake handles: handle bytes -> CPU buffer; counts opens."""
    buffers: dict[bytes, torch.Tensor] = {}
    opened: list[tuple[bytes, int]] = []

    def open_fake(handle, nbytes):
        opened.append((handle.handle, handle.device))
        if handle.handle not in buffers:
            raise RuntimeError("invalid resource handle")
        return buffers[handle.handle][:nbytes]

    monkeypatch.setattr(ipc, "LOCAL_MAPPINGS", MappingCache(open_fake))
    return buffers, opened


def test_one_received_type_for_tensors_and_ipc_references(opener):
    pairs = [("a.weight", torch.zeros(2, 3))]
    plain = as_version(pairs, 3)
    assert plain.ipc is None and plain.version == 3 and list(plain.named_tensors()) == pairs
    assert as_version(plain, 7) is plain
    buffers, _ = opener
    buffer, layout = shared({"a.weight": torch.ones(2, 3)})
    buffers[b"h1"] = buffer
    received = ipc_version(layout, version=3)
    assert received.ipc is layout and received.num_bytes == buffer.numel()
    assert torch.equal(dict(received.named_tensors())["a.weight"], torch.ones(2, 3))  # mapped here on use


def test_the_mapping_is_cached_per_layout_and_remapped_when_it_changes():
    opened = []
    cache = MappingCache(
        lambda h, n: opened.append((h.handle, h.device, n)) or torch.zeros(n, dtype=torch.uint8)
    )
    _, first = shared({"a.weight": torch.ones(2, 3)}, layout_id=1, handle=b"h1")
    _, again = shared({"a.weight": torch.ones(2, 3)}, layout_id=1, handle=b"h1")
    _, moved = shared({"a.weight": torch.ones(2, 3)}, layout_id=2, handle=b"h2")
    one = cache.get(first)
    assert cache.get(again) is one and cache.opened == 1  # an equal reference (a new sync) maps nothing
    assert cache.get(moved) is not one and cache.opened == 2
    cache.get(moved, device=3)  # the worker maps on its own device index
    assert opened[-1][:2] == (b"h2", 3) and cache.opened == 3
    cache.release()
    cache.get(moved, device=3)
    assert cache.opened == 4


def test_an_ipc_update_loads_from_the_mapped_buffer_with_only_the_reference_sent(checkpoint, opener):
    path, disk = checkpoint
    buffers, opened = opener
    model = FakeModel(disk)
    llm = ProcessLLM(model)
    loader = WeightLoader(path, method="load_weights", in_process=False, keep_rollback_copy=False)
    new = {"a.weight": torch.full((2, 3), 5.0), "c.weight": torch.full((3,), 7.0)}
    buffer, layout = shared(new)
    buffers[b"h1"] = buffer
    assert loader.apply(llm, ipc_version(layout)) == 2
    assert torch.equal(model.params["a.weight"], new["a.weight"]) and torch.equal(
        model.params["c.weight"], new["c.weight"]
    )
    assert torch.equal(model.params["b.weight"], disk["b.weight"])
    assert llm.sent[-1] < 4096  # the reference, not the weights
    pack_bucket(
        buffer, layout.manifest.tensors, [torch.full((2, 3), 6.0), torch.full((3,), 8.0)]
    )  # next version
    loader.apply(llm, ipc_version(layout))
    assert torch.equal(model.params["a.weight"], torch.full((2, 3), 6.0))
    assert len(opened) == 1  # mapped once across syncs


def test_an_ipc_manifest_is_validated_before_the_worker_sees_it(checkpoint, opener):
    path, disk = checkpoint
    model = FakeModel(disk)
    llm = ProcessLLM(model)
    loader = WeightLoader(path, method="load_weights", in_process=False, keep_rollback_copy=True)
    cases = [
        ({"a.weight": torch.zeros(3, 2)}, "shape"),
        ({"zzz": torch.zeros(1)}, "not a tensor"),
        ({"b.weight": torch.ones(4, dtype=torch.int64)}, "dtype"),
    ]
    for tensors, match in cases:
        _, layout = shared({"c.weight": torch.full((3,), 9.0), **tensors})
        with pytest.raises(WeightLoadError, match=match):
            loader.apply(llm, ipc_version(layout))
    _, layout = shared({"c.weight": torch.full((3,), 9.0)})
    spec = layout.manifest.tensors[0]
    bad = msgspec.structs.replace(
        layout,
        manifest=msgspec.structs.replace(
            layout.manifest,
            tensors=[TensorSpec(spec.name, spec.dtype, spec.shape, 0, spec.offset, spec.nbytes + 4)],
        ),
    )
    with pytest.raises(WeightLoadError, match="manifest"):
        loader.apply(llm, ipc_version(bad))
    empty = msgspec.structs.replace(layout, manifest=msgspec.structs.replace(layout.manifest, tensors=[]))
    with pytest.raises(WeightLoadError, match="empty"):
        loader.apply(llm, ipc_version(empty))
    assert llm.sent == [] and model.loads == 0  # nothing reached the worker


def test_an_unmappable_buffer_is_refused_without_a_rollback(checkpoint, opener):
    path, disk = checkpoint
    model = FakeModel(disk)
    llm = ProcessLLM(model)
    loader = WeightLoader(path, method="reload", in_process=False, keep_rollback_copy=True)
    _, layout = shared({"c.weight": torch.full((3,), 9.0)}, handle=b"stale")  # the opener does not know it
    with pytest.raises(WeightLoadError, match="cannot map") as info:
        loader.apply(llm, ipc_version(layout))
    assert not isinstance(info.value, WeightsRolledBack)
    assert model.loads == 0 and len(llm.sent) == 1


def test_an_ipc_load_failing_half_way_is_rolled_back_to_the_last_good_weights(checkpoint, opener):
    path, disk = checkpoint
    buffers, _ = opener
    model = FakeModel(disk)
    llm = ProcessLLM(model)
    loader = WeightLoader(path, method="reload", in_process=False, keep_rollback_copy=True)
    buffer, layout = shared({"a.weight": torch.full((2, 3), 5.0)})  # version 1: a partial update over IPC
    buffers[b"h1"] = buffer
    loader.apply(llm, ipc_version(layout))
    pack_bucket(buffer, layout.manifest.tensors, [torch.full((2, 3), -1.0)])  # the learner moves on
    good = {k: v.clone() for k, v in model.params.items()}
    assert torch.equal(good["a.weight"], torch.full((2, 3), 5.0))  # the rollback copy was taken at load time
    buffer2, layout2 = shared(
        {"b.weight": torch.full((4,), 7.0), "c.weight": torch.full((3,), 7.0), "a.weight": torch.ones(2, 3)},
        layout_id=2,
        handle=b"h2",
    )
    buffers[b"h2"] = buffer2
    model.fail_after = 2
    with pytest.raises(WeightsRolledBack, match="boom"):
        loader.apply(llm, ipc_version(layout2))
    for name, value in good.items():  # b and c had been overwritten; the rollback restored them, kept v1's a
        assert torch.equal(model.params[name], value), name


def test_the_engine_core_runs_in_its_own_process_by_default_on_cuda_only():
    assert resolve_in_process(None, tp=1, on_cpu=False) is False
    assert resolve_in_process(None, tp=1, on_cpu=True) is True
    assert resolve_in_process(True, tp=1, on_cpu=False) is True
    assert resolve_in_process(False, tp=1, on_cpu=True) is False
    assert resolve_in_process(True, tp=2, on_cpu=False) is False


def test_in_process_setting_from_toml_and_flags(tmp_path):
    from generator.config import GeneratorConfig
    from runtime.config import load_config

    assert load_config(GeneratorConfig, []).engine.in_process is None
    toml = tmp_path / "g.toml"
    toml.write_text("[engine]\nin_process = true\n")
    assert load_config(GeneratorConfig, ["--config", str(toml)]).engine.in_process is True
    assert load_config(GeneratorConfig, ["--engine.in-process", "False"]).engine.in_process is False
