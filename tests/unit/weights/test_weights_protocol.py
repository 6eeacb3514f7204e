"""The weight-sync wire protocol without processes: layout, packing, verification, names, loading."""

from __future__ import annotations

import msgspec
import pytest
import torch
from safetensors import safe_open
from weights_procs import Net, digest, perturb

from weights.manifest import (
    ALIGN,
    checkpoint_names,
    checksum,
    module_loader,
    named_tensors,
    pack_bucket,
    plan_layout,
    trailer,
    validate_manifest,
    verify,
    views,
)
from weights.protocol import JoinRequest, Manifest, WeightSyncError, decode, encode


def _pack(model, bucket_bytes):
    names = checkpoint_names(model)
    tensors = list(named_tensors(model))
    layout = plan_layout([(names[n], t.dtype, tuple(t.shape)) for n, t in tensors], bucket_bytes)
    manifest = Manifest(version=7, tensors=layout.tensors, bucket_nbytes=layout.bucket_nbytes)
    buffers = []
    for b, nbytes in enumerate(layout.bucket_nbytes):
        buf = torch.empty(nbytes, dtype=torch.uint8)
        idx = layout.bucket_members(b)
        pack_bucket(buf, [layout.tensors[i] for i in idx], [tensors[i][1] for i in idx])
        buffers.append(buf)
    return manifest, buffers


def test_layout_aligns_and_gives_big_tensors_their_own_bucket():
    entries = [
        ("a", torch.float32, (3,)),
        ("b", torch.bfloat16, (1000,)),
        ("c", torch.int64, ()),
        ("d", torch.bool, (5,)),
    ]
    layout = plan_layout(entries, bucket_bytes=256)
    assert [t.bucket for t in layout.tensors] == [0, 1, 2, 2]
    assert all(t.offset % ALIGN == 0 for t in layout.tensors)
    assert layout.bucket_nbytes == [16, 2000, 32]
    with pytest.raises(ValueError):
        plan_layout(entries, bucket_bytes=8)


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_pack_unpack_is_bit_exact_and_skips_non_persistent_and_tied(bucket_bytes):
    model = Net(seed=1)
    manifest, buffers = _pack(model, bucket_bytes)
    verify(manifest, buffers, trailer(7, [checksum(b) for b in buffers]))
    received = dict(views(manifest, buffers))
    assert set(received) == {"emb.weight", "proj.weight", "proj.bias", "scale", "steps"}
    state = model.state_dict()
    for name, tensor in received.items():
        assert tensor.dtype == state[name].dtype
        assert torch.equal(tensor.reshape(-1).view(torch.uint8), state[name].reshape(-1).view(torch.uint8))


def test_verify_rejects_corruption_truncation_and_wrong_version():
    manifest, buffers = _pack(Net(), 256)
    sums = [checksum(b) for b in buffers]
    buffers[1][5] ^= 0x10
    with pytest.raises(WeightSyncError, match="checksum"):
        verify(manifest, buffers, trailer(7, sums))
    buffers[1][5] ^= 0x10
    with pytest.raises(WeightSyncError, match="version"):
        verify(manifest, buffers, trailer(8, sums))
    with pytest.raises(WeightSyncError, match="buckets"):
        verify(manifest, buffers[:-1], trailer(7, sums[:-1]))


def test_decode_rejects_malformed_and_unknown_versions():
    with pytest.raises(WeightSyncError, match="malformed"):
        decode(b"\x93garbage", Manifest)
    with pytest.raises(WeightSyncError, match="wire version"):
        decode(
            encode(JoinRequest(generator_id="g", token="t", transport="broadcast", wire_version=99)),
            JoinRequest,
        )
    request = JoinRequest(generator_id="g", token="t", transport="broadcast", version=3)
    assert decode(encode(request), JoinRequest).version == 3


def test_validate_manifest_rejects_inconsistent_layouts():
    manifest, _ = _pack(Net(), 256)
    bad = msgspec.structs.replace(manifest.tensors[0], nbytes=manifest.tensors[0].nbytes + 4)
    with pytest.raises(WeightSyncError, match="inconsistent"):
        validate_manifest(msgspec.structs.replace(manifest, tensors=[bad, *manifest.tensors[1:]]))
    bad = msgspec.structs.replace(manifest.tensors[0], dtype="complex32")
    with pytest.raises(WeightSyncError, match="dtype"):
        validate_manifest(msgspec.structs.replace(manifest, tensors=[bad]))


def test_checkpoint_names_match_what_save_pretrained_writes(tiny_model_dir, tiny_model):
    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    names = checkpoint_names(tiny_model)
    assert set(names.values()) == saved
    assert any(n.startswith("model.language_model.") for n in names)  # transformers 5 module names ...
    assert any(c.startswith("visual.") for c in names.values())  # ... become checkpoint names on the wire


def test_module_loader_is_all_or_nothing():
    source, target = Net(seed=1), Net(seed=2)
    manifest, buffers = _pack(source, 256)
    before = digest(target)
    bad = [*views(manifest, buffers), ("not.a.weight", torch.zeros(1))]
    with pytest.raises(WeightSyncError, match="not a tensor"):
        module_loader(target)(bad, 7)
    wrong_shape = [("scale", torch.zeros(3, dtype=torch.bfloat16)), *views(manifest, buffers)]
    with pytest.raises(WeightSyncError, match="shape"):
        module_loader(target)(wrong_shape, 7)
    assert digest(target) == before
    module_loader(target)(views(manifest, buffers), 7)
    assert digest(target) == digest(source)
    perturb(source, 0.5)
    assert digest(target) != digest(source)
