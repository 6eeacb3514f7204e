"""Wire protocol of learner -> generator weight sync (shared by learner/weight_sender.py and
generator/weight_receiver.py).

A sync moves one policy *version* as:
  1. one `Manifest` (msgpack, through the rendezvous TCPStore): every tensor's checkpoint name,
     dtype, shape and place inside a bucket, plus each bucket's size and checksum;
  2. the buckets themselves: flat uint8 buffers of about `bucket_bytes` each (tensors packed
     back to back at 16-byte aligned offsets), one collective per bucket - never one message
     per parameter.
The receiver unpacks zero-copy views and hands `(name, tensor)` pairs to the engine only after
every bucket arrived and matched its checksum.

Names on the wire are the names `save_pretrained` writes (what vLLM's `load_weights` and a
checkpoint on disk use): transformers 5 renames Qwen2.5-VL modules (`model.language_model.*`,
`model.visual.*`) and reverts that on save (`model.*`, `visual.*`); `checkpoint_names` applies
the same reversion. Tied weights travel once, as in the checkpoint.

Also here: the control messages of the rendezvous (join request/accept), its key names, and
`pair_group`, which builds a 2-rank process group (learner rank 0, one generator rank 1) on a
shared TCPStore without `init_process_group`. No pickle anywhere.
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import msgspec
import torch

WIRE_VERSION = 1
"""Bump when a manifest or control field changes meaning."""
ALIGN = 16
"""Byte alignment of every tensor inside a bucket (keeps `.view(dtype)` legal for all dtypes)."""
DEFAULT_BUCKET_BYTES = 256 << 20

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
}


class WeightTransferError(RuntimeError):
    """A manifest, control message or received version is malformed or does not validate."""


class TensorSpec(msgspec.Struct, frozen=True):
    """Where one tensor lives in the packed stream."""

    name: str
    """Checkpoint name, e.g. "model.layers.0.mlp.up_proj.weight"."""
    dtype: str
    shape: list[int]
    bucket: int
    offset: int
    """Byte offset inside its bucket (a multiple of ALIGN)."""
    nbytes: int


class Manifest(msgspec.Struct, kw_only=True):
    """Everything a receiver needs to allocate, receive and validate one version."""

    version: int
    step: int = 0
    tensors: list[TensorSpec]
    bucket_nbytes: list[int]
    """Size of each flat uint8 bucket buffer (multiples of ALIGN), in sending order."""
    checksums: bool = True
    """Whether the trailer carries real checksums (else zeros, not checked)."""
    wire_version: int = WIRE_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_nbytes)


class JoinRequest(msgspec.Struct, kw_only=True):
    """A generator asks to join the weights group."""

    generator_id: str
    version: int = -1
    """Version the generator serves now (-1: none); the learner skips a catch-up send of that version."""
    host: str = ""
    """Address of this generator's side of the group (gloo binds to it)."""
    device_uuid: str = ""
    """UUID of the GPU the generator receives on ("" on CPU): NCCL cannot pair two ranks on one GPU."""
    wire_version: int = WIRE_VERSION


class JoinAccept(msgspec.Struct, kw_only=True):
    """The learner's answer: which session (process-group prefix) to build, with which backend."""

    session: int
    backend: str = "gloo"
    timeout_s: float = 60.0
    wire_version: int = WIRE_VERSION


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(msg)


def decode(data: bytes, kind: type[msgspec.Struct]):
    """Decode a control message or manifest; anything malformed raises WeightTransferError."""
    try:
        msg = msgspec.msgpack.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WeightTransferError(f"malformed {kind.__name__}: {e}") from e
    if msg.wire_version != WIRE_VERSION:
        raise WeightTransferError(
            f"{kind.__name__} has wire version {msg.wire_version}, expected {WIRE_VERSION}"
        )
    return msg


class Keys:
    """Key names inside the weight-sync TCPStore (the learner hosts it; generators are clients).

    A receiver blocks on the key of its next manifest; writing `ENDED + reason` there instead of
    a manifest ends the session (the learner dropping it, or the receiver's own `close`)."""

    ENDED = b"\x00ended:"

    JOIN_SEQ = "join/seq"

    @staticmethod
    def join(ticket: int) -> str:
        return f"join/{ticket}"

    @staticmethod
    def accept(ticket: int) -> str:
        return f"join/{ticket}/accept"

    @staticmethod
    def group(session: int) -> str:
        """PrefixStore prefix of the session's process-group rendezvous."""
        return f"pg/{session}/"

    @staticmethod
    def manifest(session: int, transfer: int) -> str:
        return f"s/{session}/x/{transfer}"

    @staticmethod
    def served(session: int) -> str:
        """Last version the generator received and validated (written by the receiver)."""
        return f"s/{session}/served"


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise WeightTransferError(f"unsupported dtype {name!r} (known: {sorted(_DTYPES)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    dtype_from_name(name)
    return name


@dataclass
class ReceiverStats:
    """Counters of a generator-side weight receiver (bucketed or CUDA IPC)."""

    versions: int = 0
    bytes: int = 0
    last_seconds: float = 0.0
    failures: int = 0
    """Transfers that failed or did not verify (the previous weights stayed)."""
    apply_failures: int = 0
    joins: int = 0
    last_error: str = ""
    history: list[int] = field(default_factory=list)
    """Versions delivered, in order (last 100)."""


@dataclass(frozen=True)
class Layout:
    """Bucket assignment of a list of tensors (no checksums; those depend on the data)."""

    tensors: list[TensorSpec]
    bucket_nbytes: list[int]

    def bucket_members(self, bucket: int) -> list[int]:
        return [i for i, t in enumerate(self.tensors) if t.bucket == bucket]


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_layout(entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> Layout:
    """Assign tensors, in order, to buckets of <= `bucket_bytes` (a bigger tensor gets its own bucket)."""
    if bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be >= {ALIGN}, got {bucket_bytes}")
    specs: list[TensorSpec] = []
    sizes: list[int] = []
    for name, dtype, shape in entries:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if not sizes or (sizes[-1] > 0 and sizes[-1] + _aligned(nbytes) > bucket_bytes):
            sizes.append(0)
        specs.append(TensorSpec(name, dtype_name(dtype), list(shape), len(sizes) - 1, sizes[-1], nbytes))
        sizes[-1] += _aligned(nbytes)
    return Layout(specs, [max(s, ALIGN) for s in sizes])


def checksum(buffer: torch.Tensor) -> int:
    """Cheap device-side checksum of a uint8 buffer whose size is a multiple of 8: the wrapping sum of
    its int64 words (modular, so any device and summation order agree). It catches missing, truncated
    or garbled data, not reordered words. (An int32 -> int64 accumulating sum costs 15x more on CPU.)"""
    return int(buffer.view(torch.int64).sum().item())


def tensor_view(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The tensor `spec` describes, as a view into its bucket's buffer."""
    raw = buffer[spec.offset : spec.offset + spec.nbytes]
    return raw.view(dtype_from_name(spec.dtype)).view(spec.shape)


def pack_bucket(buffer: torch.Tensor, specs: Iterable[TensorSpec], tensors: Iterable[torch.Tensor]) -> None:
    """Copy `tensors` into their places in `buffer`; the alignment gaps are zeroed (checksums are stable)."""
    end = 0
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
        raise WeightTransferError("bucket sizes must be positive multiples of 16")
    for spec in manifest.tensors:
        dtype = dtype_from_name(spec.dtype)
        if not 0 <= spec.bucket < len(sizes):
            raise WeightTransferError(f"{spec.name}: bucket {spec.bucket} out of range")
        expect = torch.Size(spec.shape).numel() * dtype.itemsize
        if spec.nbytes != expect or spec.offset % ALIGN or spec.offset + spec.nbytes > sizes[spec.bucket]:
            raise WeightTransferError(f"{spec.name}: inconsistent size/offset in manifest")


def trailer(version: int, checksums: list[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The last message of a version: [version, checksum of bucket 0, 1, ...] as int64."""
    return torch.tensor([version, *checksums], dtype=torch.int64, device=device)


def verify(manifest: Manifest, buffers: list[torch.Tensor], received_trailer: torch.Tensor) -> None:
    """Raise WeightTransferError unless every bucket arrived with the right size and checksum."""
    sums = received_trailer.tolist()
    if len(buffers) != len(manifest.bucket_nbytes) or len(sums) != len(buffers) + 1:
        raise WeightTransferError(f"got {len(buffers)} of {len(manifest.bucket_nbytes)} buckets")
    if sums[0] != manifest.version:
        raise WeightTransferError(f"trailer is for version {sums[0]}, manifest for {manifest.version}")
    for i, (nbytes, buf) in enumerate(zip(manifest.bucket_nbytes, buffers)):
        if buf.numel() != nbytes:
            raise WeightTransferError(f"bucket {i}: {buf.numel()} bytes, expected {nbytes}")
        if manifest.checksums and checksum(buf) != sums[i + 1]:
            raise WeightTransferError(f"bucket {i}: checksum mismatch (version {manifest.version})")


def unpack(manifest: Manifest, buffers: list[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor view) pairs of a received, verified version."""
    for spec in manifest.tensors:
        yield spec.name, tensor_view(buffers[spec.bucket], spec)


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
        raise WeightTransferError(f"{type(model).__name__}: checkpoint conversion is not a pure renaming")
    return mapping


def device_uuid(device: torch.device | str) -> str:
    """The GPU's UUID for a CUDA device, "" otherwise."""
    device = torch.device(device)
    if device.type != "cuda":
        return ""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def local_host_towards(host: str) -> str:
    """The local address that routes to `host` (what our side of a gloo pair binds to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def pair_group(backend: str, store, session: int, rank: int, timeout_s: float, host: str):
    """A 2-rank process group (0 = learner, 1 = generator) on `store`, without init_process_group.

    Construction is a rendezvous: it blocks until the other side constructs too (or `timeout_s`).
    """
    from torch.distributed import PrefixStore

    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = PrefixStore(Keys.group(session), store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        return ProcessGroupGloo(prefixed, rank, 2, opts)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        # wait_work() polls with `timeout_s` and aborts the group; NCCL's own watchdog (which would
        # tear the whole process down) gets a later deadline so that ours always fires first.
        opts._timeout = 2 * timeout + datetime.timedelta(seconds=30)
        return ProcessGroupNCCL(prefixed, rank, 2, opts)
    raise ValueError(f"unknown weight-sync backend {backend!r} (gloo or nccl)")


def wait_work(work, backend: str, timeout_s: float) -> None:
    """Wait for one collective; raise on error or after `timeout_s`.

    gloo enforces its group timeout itself. NCCL work completes asynchronously and its own
    watchdog would tear the process down, so it is polled here with our own deadline.
    """
    if backend != "nccl":
        work.wait()
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"collective did not finish within {timeout_s} s")
        time.sleep(0.0005)
    work.wait()
