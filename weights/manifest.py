"""Packed versions: which tensors a model sends, where each lies in a bucket, and views of a buffer.

Written once for both transports: `wire_tensors` lists a model's tensors (parameters once, tied ones
once, persistent buffers) under the names `save_pretrained` writes, `plan_layout` places them in
buckets at 16-byte aligned offsets, `pack_bucket` copies them in (gathering FSDP2 shards with `full`),
`views` / `tensor_view` read them back out of a buffer without a copy, `verify` checks a received
version against its manifest and trailer.

Names: transformers 5 renames Qwen2.5-VL modules at load time (`model.language_model.*`,
`model.visual.*`) and reverts that on save (`model.*`, `visual.*`); `checkpoint_names` applies the
same reversion, so vLLM's `load_weights` and a checkpoint on disk take what arrives as is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from weights.inplace import Slots
from weights.protocol import Manifest, TensorSpec, WeightSyncError, dtype_from_name, dtype_name

ALIGN = 16
"""Byte alignment of every tensor inside a bucket (keeps `.view(dtype)` legal for all dtypes)."""


@dataclass(frozen=True)
class Layout:
    """Bucket assignment of a list of tensors (no checksums; those depend on the data)."""

    tensors: list[TensorSpec]
    bucket_nbytes: list[int]

    def bucket_members(self, bucket: int) -> list[int]:
        return [i for i, t in enumerate(self.tensors) if t.bucket == bucket]


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_layout(entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> Layout:
    """Assign tensors, in order, to buckets of <= `bucket_bytes` (a bigger tensor gets its own bucket)."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    specs: list[TensorSpec] = []
    sizes: list[int] = []
    for name, dtype, shape in entries:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if not sizes or (sizes[-1] > 0 and sizes[-1] + aligned(nbytes) > bucket_bytes):
            sizes.append(0)
        specs.append(TensorSpec(name, dtype_name(dtype), list(shape), len(sizes) - 1, sizes[-1], nbytes))
        sizes[-1] += aligned(nbytes)
    return Layout(specs, [max(s, ALIGN) for s in sizes])


def one_buffer(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> Layout:
    """The layout of every entry in a single buffer (cuda-ipc)."""
    total = sum(aligned(torch.Size(shape).numel() * dtype.itemsize) for _, dtype, shape in entries)
    return plan_layout(entries, max(total, ALIGN))


def checksum(buffer: torch.Tensor) -> int:
    """Cheap device-side checksum of a uint8 buffer whose size is a multiple of 8: the wrapping sum of
    its int64 words (modular, so any device and summation order agree). It catches missing, truncated
    or garbled data, not reordered words. (An int32 -> int64 accumulating sum costs 15x more on CPU.)"""
    return int(buffer.view(torch.int64).sum().item())


def tensor_view(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor `spec` describes, as a view into its bucket's buffer."""
    raw = buffer[spec.offset : spec.offset + spec.nbytes]
    return raw.view(dtype_from_name(spec.dtype)).view(spec.shape)


def views(manifest: Manifest, buffers: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor view) of every tensor of `manifest`, read from its bucket buffers."""
    for spec in manifest.tensors:
        yield spec.name, tensor_view(buffers[spec.bucket], spec)


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered when it is an FSDP2 DTensor (collective over the shards), else itself."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def pack_bucket(buffer: torch.Tensor, specs: Iterable[TensorSpec], tensors: Iterable[torch.Tensor]) -> None:
    """Copy (and cast) `tensors` into their places in `buffer`; gaps are zeroed (stable checksums)."""
    end = 0
    with torch.no_grad():
        for spec, tensor in zip(specs, tensors, strict=True):
            if spec.offset > end:
                buffer[end : spec.offset].zero_()
            tensor_view(buffer, spec).copy_(tensor.detach())
            end = spec.offset + spec.nbytes
        buffer[end:].zero_()


def validate_manifest(manifest: Manifest) -> None:
    """Structural checks before allocating anything: known dtypes, sizes and offsets that fit."""
    sizes = manifest.bucket_nbytes
    if any(n <= 0 or n % ALIGN for n in sizes):
        raise WeightSyncError("bucket sizes must be positive multiples of 16")
    for spec in manifest.tensors:
        dtype = dtype_from_name(spec.dtype)
        if not 0 <= spec.bucket < len(sizes):
            raise WeightSyncError(f"{spec.name}: bucket {spec.bucket} out of range")
        expect = torch.Size(spec.shape).numel() * dtype.itemsize
        if spec.nbytes != expect or spec.offset % ALIGN or spec.offset + spec.nbytes > sizes[spec.bucket]:
            raise WeightSyncError(f"{spec.name}: inconsistent size/offset in manifest")


def trailer(version: int, checksums: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The last message of a version: [version, checksum of bucket 0, 1, ...] as int64."""
    return torch.tensor([version, *checksums], dtype=torch.int64, device=device)


def verify(manifest: Manifest, buffers: list[torch.Tensor], received_trailer: torch.Tensor) -> None:
    """Raise WeightSyncError unless every bucket arrived with the right size and checksum."""
    sums = received_trailer.tolist()
    if len(buffers) != len(manifest.bucket_nbytes) or len(sums) != len(buffers) + 1:
        raise WeightSyncError(f"got {len(buffers)} of {len(manifest.bucket_nbytes)} buckets")
    if sums[0] != manifest.version:
        raise WeightSyncError(f"trailer is for version {sums[0]}, manifest for {manifest.version}")
    for i, (nbytes, buf) in enumerate(zip(manifest.bucket_nbytes, buffers)):
        if buf.numel() != nbytes:
            raise WeightSyncError(f"bucket {i}: {buf.numel()} bytes, expected {nbytes}")
        if manifest.checksums and checksum(buf) != sums[i + 1]:
            raise WeightSyncError(f"bucket {i}: checksum mismatch (version {manifest.version})")


def named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (tied ones once) and persistent buffers, in module order: what a checkpoint holds."""
    seen: set[int] = set()
    for name, param in model.named_parameters():
        seen.add(id(param))
        yield name, param
    for mod_name, mod in model.named_modules():
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf_name in mod._non_persistent_buffers_set or id(buf) in seen:
                continue
            seen.add(id(buf))
            yield (f"{mod_name}.{buf_name}" if mod_name else buf_name), buf


def checkpoint_names(model: torch.nn.Module) -> dict[str, str]:
    """Module name -> the name `save_pretrained` writes, for every tensor of `named_tensors(model)`.

    Uses transformers' own reversion of its load-time renaming (identity for non-transformers
    modules); conversions that merge or split tensors are not supported and raise.
    """
    tensors = dict(named_tensors(model))
    try:
        from transformers import PreTrainedModel
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return {n: n for n in tensors}
    if not isinstance(model, PreTrainedModel):
        return {n: n for n in tensors}
    metas = {n: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for n, t in tensors.items()}
    by_id = {id(t): n for n, t in metas.items()}
    reverted = revert_weight_conversion(model, dict(metas))
    mapping = {by_id.get(id(t)): new for new, t in reverted.items()}
    if len(reverted) != len(metas) or None in mapping:
        raise WeightSyncError(f"{type(model).__name__}: checkpoint conversion is not a pure renaming")
    return mapping


def wire_dtype(send_dtype: str, device: torch.device) -> torch.dtype | None:
    """The dtype floating-point tensors travel in (None: each its own), from the learner's `send_dtype`."""
    if send_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    if send_dtype in ("keep", ""):
        return None
    return dtype_from_name(send_dtype)


class WireTensors:
    """A model's tensors as they go on the wire (worked out once per model): wire names, dtypes and
    shapes (`entries`), in checkpoint layout or vLLM's (weights/vllm_layout.py: `parts` says which
    checkpoint tensors each wire tensor stacks, `slots` where each model tensor goes)."""

    def __init__(
        self, model: torch.nn.Module, send_dtype: str, layout: str = "checkpoint", transport: str = ""
    ):
        from weights import vllm_layout

        self.model = model
        layout = vllm_layout.resolve(layout, model, transport)  # "auto": the layout `transport` takes
        self.layout = layout
        names = checkpoint_names(model)
        tensors = list(named_tensors(model))
        self._slots = Slots(model, [n for n, _ in tensors])
        cast = wire_dtype(send_dtype, tensors[0][1].device if tensors else torch.device("cpu"))
        entries = [
            (names[n], cast if cast is not None and t.is_floating_point() else t.dtype, tuple(t.shape))
            for n, t in tensors
        ]
        if layout == "vllm":
            self.entries, parts, owner = vllm_layout.plan(entries)
            self.parts = {e[0]: [(p.name, p.rows) for p in ps] for e, ps in zip(self.entries, parts)}
            place = {p.name: k for ps in parts for k, p in enumerate(ps)}
            self.slots = [(owner[j], place[entries[j][0]]) for j in range(len(entries))]
        else:
            self.entries, self.parts = entries, {}
            self.slots = [(j, 0) for j in range(len(entries))]
        self.members = [
            [j for j, (w, _) in enumerate(self.slots) if w == i] for i in range(len(self.entries))
        ]
        """Model tensors of each wire tensor, in stacking order."""

    def tensors(self) -> list[torch.Tensor]:
        """The model's current tensors (DTensor shards of an FSDP2 model: `full` gathers each), read from
        their places in the module tree (`weights.inplace.Slots`, resolved once per model)."""
        return self._slots.read()

    def gather(self, tensors: list[torch.Tensor], i: int) -> torch.Tensor:
        """Wire tensor `i`, whole (its parts gathered and, for a stack, concatenated)."""
        members = [full(tensors[j]) for j in self.members[i]]
        return members[0] if len(members) == 1 else torch.cat([m.detach() for m in members])

    def manifest(self, layout: Layout, version: int, step: int, checksums: bool) -> Manifest:
        return Manifest(
            version=version,
            step=step,
            tensors=layout.tensors,
            bucket_nbytes=layout.bucket_nbytes,
            checksums=checksums,
            layout=self.layout,
            parts=self.parts,
        )


def module_loader(model: torch.nn.Module):
    """Reference `apply` callback: copy received checkpoint-named tensors into `model`, all or nothing.

    Every name must belong to the model and every shape must match before anything is copied;
    a mismatch raises WeightSyncError and leaves the model untouched.
    """
    by_checkpoint = {ckpt: name for name, ckpt in checkpoint_names(model).items()}
    targets = dict(named_tensors(model))

    def apply(tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        pairs = []
        for name, tensor in tensors:
            target = targets.get(by_checkpoint.get(name, ""))
            if target is None:
                raise WeightSyncError(f"version {version}: {name!r} is not a tensor of the model")
            if tuple(target.shape) != tuple(tensor.shape):
                raise WeightSyncError(
                    f"version {version}: {name} has shape {tuple(tensor.shape)}, model {tuple(target.shape)}"
                )
            pairs.append((target, tensor))
        with torch.no_grad():
            for target, tensor in pairs:
                target.copy_(tensor)

    return apply
