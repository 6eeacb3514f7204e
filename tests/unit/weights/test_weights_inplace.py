"""Whole-version copies in place (weights/inplace.py) and what each side works out once: the learner's
tensor places (`Slots`), the worker's prepared layout (weights/vllm_worker.py) and the front end's
validated layout (`WeightLoader.validate_layout`), each checked to notice what changed since."""

from __future__ import annotations

import msgspec
import pytest
import torch
from fake_worker import shared
from torch import nn

from weights import ipc, vllm_worker
from weights.config import CudaIpcTransport, WeightSenderConfig
from weights.inplace import Slots, copy_all
from weights.ipc import MappingCache
from weights.ipc_sender import IpcSender
from weights.manifest import one_buffer, pack_bucket
from weights.protocol import Manifest
from weights.vllm_apply import WeightLoader, WeightLoadError
from weights.vllm_layout import plan


def test_copy_all_copies_big_and_small_tensors_and_checks_every_shape_first():
    srcs = [torch.randn(64, 32), torch.randn(3), torch.randn(5, 2).to(torch.float64)]
    dsts = [torch.zeros(64, 32), torch.zeros(3), torch.zeros(5, 2)]
    copy_all(dsts, srcs, big_bytes=1024)  # the first one by itself, the others in one foreach copy
    for d, s in zip(dsts, srcs):
        torch.testing.assert_close(d, s.to(d.dtype))
    fresh = [torch.zeros(64, 32), torch.zeros(4)]
    with pytest.raises(ValueError, match="shape"):
        copy_all(fresh, [srcs[0], srcs[1]], big_bytes=1024)
    assert not fresh[0].any()  # refused before the first write


def test_slots_read_a_replaced_parameter_and_notice_a_removed_one():
    model = nn.Sequential(nn.Linear(2, 3), nn.LayerNorm(3))
    model.register_buffer("scale", torch.ones(1))
    slots = Slots(model, ["0.weight", "1.bias", "scale"])
    new = nn.Parameter(torch.full((3, 2), 7.0))
    model[0].weight = new
    assert slots.read()[0] is new and slots.read()[2] is model.scale
    del model[1].bias
    with pytest.raises(KeyError, match="removed"):
        slots.read()


class Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(3, 2, bias=False)


def test_the_sender_packs_a_parameter_replaced_after_its_first_sync(fake_ipc):
    model = Two()
    sender = IpcSender(WeightSenderConfig(transport=CudaIpcTransport(), send_dtype="keep"))
    try:
        sender.sync(model, version=1)
        model.b.weight = nn.Parameter(torch.full((2, 3), 5.0))  # e.g. load_state_dict(assign=True)
        sender.sync(model, version=2)
        packed = dict(zip(["a.weight", "a.bias", "b.weight"], sender._views))
        assert torch.equal(packed["b.weight"], model.b.weight.detach())
    finally:
        sender.close()


def _vllm_model() -> nn.Module:
    """vLLM's names for a fused qkv and an embedding that does not fit the wire shape (loads by name)."""
    root, attn = nn.Module(), nn.Module()
    attn.qkv_proj = nn.Module()
    attn.qkv_proj.register_parameter("weight", nn.Parameter(torch.zeros(8, 2), requires_grad=False))
    layer = nn.Module()
    layer.self_attn = attn
    inner = nn.Module()
    inner.layers = nn.ModuleList([layer])
    inner.embed_tokens = nn.Module()
    inner.embed_tokens.register_parameter("weight", nn.Parameter(torch.zeros(1, 2), requires_grad=False))
    root.language_model = nn.Module()
    root.language_model.model = inner
    root.loaded = []
    root.load_weights = lambda pairs: root.loaded.extend(pairs)
    return root


@pytest.fixture
def vllm_version(monkeypatch):
    """(worker, encoded layout, buffer, q, k, v, emb): a version in vLLM's layout in a (CPU) buffer."""
    q, k, v, emb = torch.randn(4, 2), torch.randn(2, 2), torch.randn(2, 2), torch.randn(3, 2)
    checkpoint = [
        ("model.layers.0.self_attn.q_proj.weight", q),
        ("model.layers.0.self_attn.k_proj.weight", k),
        ("model.layers.0.self_attn.v_proj.weight", v),
        ("model.embed_tokens.weight", emb),
    ]
    entries, parts, _ = plan([(n, t.dtype, tuple(t.shape)) for n, t in checkpoint])
    layout = one_buffer(entries)
    buffer = torch.zeros(layout.bucket_nbytes[0], dtype=torch.uint8)
    pack_bucket(buffer, layout.tensors, [torch.cat([q, k, v]), emb])
    manifest = Manifest(
        version=-1,
        tensors=layout.tensors,
        bucket_nbytes=layout.bucket_nbytes,
        checksums=False,
        layout="vllm",
        parts={e[0]: [(p.name, p.rows) for p in ps] for e, ps in zip(entries, parts)},
    )
    handle = ipc.IpcHandle(0, b"h", buffer.numel(), 0, b"r", 0, b"e", False)
    msg = msgspec.msgpack.encode(
        ipc.IpcLayout(layout_id=1, nbytes=buffer.numel(), handle=handle, manifest=manifest)
    )
    monkeypatch.setattr(ipc, "LOCAL_MAPPINGS", MappingCache(lambda h, n: buffer))
    monkeypatch.setattr(vllm_worker, "_PREPARED", [])
    model = _vllm_model()
    worker = type("Worker", (), {})()
    worker.model_runner = type("Runner", (), {"model": model})()
    return worker, msg, buffer, q, k, v, emb


def test_the_worker_copies_fitting_parameters_and_loads_the_rest_by_checkpoint_name(vllm_version):
    worker, msg, _, q, k, v, emb = vllm_version
    model = worker.model_runner.model
    qkv = model.language_model.model.layers[0].self_attn.qkv_proj.weight
    assert vllm_worker.load_ipc_in_worker(worker, msg, "load_weights") == {"loaded": 2}
    assert torch.equal(qkv, torch.cat([q, k, v]))
    assert [n for n, _ in model.loaded] == ["model.embed_tokens.weight"]
    assert torch.equal(model.loaded[0][1], emb)


def test_the_worker_prepares_a_layout_once_and_follows_a_replaced_parameter(vllm_version, monkeypatch):
    worker, msg, buffer, q, k, v, _ = vllm_version
    model = worker.model_runner.model
    vllm_worker.load_ipc_in_worker(worker, msg, "load_weights")
    (prepared,) = vllm_worker._PREPARED
    vllm_worker.load_ipc_in_worker(worker, msg, "load_weights")
    assert vllm_worker._PREPARED == [prepared]  # the next version of the same layout reuses it
    attn = model.language_model.model.layers[0].self_attn
    attn.qkv_proj.weight = nn.Parameter(torch.zeros(8, 2), requires_grad=False)  # a reload re-created it
    vllm_worker.load_ipc_in_worker(worker, msg, "load_weights")
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    attn.qkv_proj.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)  # another shape: by name
    vllm_worker.load_ipc_in_worker(worker, msg, "load_weights")
    assert vllm_worker._PREPARED != [prepared]
    assert [n for n, _ in model.loaded[-4:]][:3] == [
        f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"
    ]
    vllm_worker.release_mappings_in_worker(worker)
    assert vllm_worker._PREPARED == [] and ipc.LOCAL_MAPPINGS.mapped is None


def test_a_layout_that_passed_is_not_checked_again_but_a_changed_one_is(checkpoint):
    model_dir, disk = checkpoint
    loader = WeightLoader(model_dir, method="load_weights", in_process=True, keep_rollback_copy=False)
    checked, check = [], loader.check
    loader.check = lambda name, *rest: checked.append(name) or check(name, *rest)
    _, layout = shared(disk)
    msg = loader.validate_layout(layout)
    assert msgspec.msgpack.decode(msg, type=ipc.IpcLayout) == layout and len(checked) == 3
    assert loader.validate_layout(layout) == msg and len(checked) == 3  # the next version: not again
    _, other = shared({**disk, "b.weight": torch.ones(5)})
    with pytest.raises(WeightLoadError, match="shape"):
        loader.validate_layout(other)
    assert checked[3:] == ["a.weight", "b.weight"]  # checked up to the wrong shape
