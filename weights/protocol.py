"""The wire of learner -> generator weight sync: messages, key names, dtypes. No pickle anywhere.

Every message is a msgspec struct encoded as msgpack and carries `wire_version`:
  `Announcement`  what the learner publishes on the broker: transport, rendezvous "host:port", token;
  `JoinRequest`   a generator asks to join (with the run's token); `JoinAccept` answers it (or refuses);
  `Manifest`      one version: every tensor's name, dtype, shape and place in a bucket, bucket sizes.
A version moves as its manifest, then its buckets (flat uint8 buffers, tensors packed back to back at
16-byte aligned offsets: weights/manifest.py), then a trailer [version, checksum of each bucket].

`Keys` names every entry of the rendezvous TCPStore that the learner hosts (weights/rendezvous.py),
in one style: `join/...` for admission, `s/<session>/...` for everything of one admitted generator.
"""

from __future__ import annotations

import msgspec
import torch

WIRE_VERSION = 3
"""Bump when a message field changes meaning (2: token and transport in the join handshake; 3: a manifest's
payload kind, full weights or a LoRA adapter)."""

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


class WeightSyncError(RuntimeError):
    """A message, manifest or received version is malformed, refused or does not verify."""


class TensorSpec(msgspec.Struct, frozen=True):
    """Where one tensor lives in the packed stream."""

    name: str
    """Name on the wire, e.g. "model.layers.0.mlp.up_proj.weight" (checkpoint layout)."""
    dtype: str
    shape: list[int]
    bucket: int
    offset: int
    """Byte offset inside its bucket (a multiple of 16)."""
    nbytes: int


class Manifest(msgspec.Struct, kw_only=True):
    """Everything a receiver needs to allocate, receive and validate one version."""

    version: int
    step: int = 0
    tensors: list[TensorSpec]
    bucket_nbytes: list[int]
    """Size of each flat uint8 bucket buffer (multiples of 16), in sending order."""
    checksums: bool = True
    """Whether the trailer carries real checksums (else zeros, not checked)."""
    layout: str = "checkpoint"
    """"checkpoint" (names and shapes as save_pretrained writes them) or "vllm" (vLLM's stacked params)."""
    parts: dict[str, list[tuple[str, int]]] = msgspec.field(default_factory=dict)
    """layout "vllm": wire name -> the (checkpoint name, rows) it stacks, in order (vllm_layout.py)."""
    kind: str = "full"
    """"full" (every weight of the model) or "adapter" (a LoRA adapter alone, under PEFT's names:
    weights/adapter.py)."""
    adapter_config: str = ""
    """kind "adapter": the adapter's adapter_config.json."""
    wire_version: int = WIRE_VERSION

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_nbytes)


class Announcement(msgspec.Struct, kw_only=True):
    """The learner's weight sync as published on the broker (`names.weight_sync_address`)."""

    transport: str
    address: str
    """Rendezvous "host:port"; "" once the learner has closed its weight sync (`withdrawn`): generators then
    wait for the next learner's announcement instead of calling a rendezvous that is gone."""
    token: str
    wire_version: int = WIRE_VERSION

    def withdrawn(self) -> Announcement:
        """What a closing learner publishes in place of this announcement."""
        return Announcement(transport=self.transport, address="", token="")


class JoinRequest(msgspec.Struct, kw_only=True):
    """A generator asks to join the learner's weight sync."""

    generator_id: str
    token: str
    """The run's token; a request without the right one is refused."""
    transport: str
    version: int = -1
    """Version the generator serves now (-1: none); the learner skips a catch-up send of that version."""
    host: str = ""
    """broadcast: address of this generator's side of the group (gloo binds to it)."""
    device_uuid: str = ""
    """UUID of the GPU the generator receives on ("" on CPU): NCCL cannot pair two ranks on one GPU."""
    wire_version: int = WIRE_VERSION


class JoinAccept(msgspec.Struct, kw_only=True):
    """The learner's answer: the session to use, or why the request was refused."""

    session: int
    backend: str = "gloo"
    """broadcast: the process group's backend for this generator."""
    timeout_s: float = 60.0
    refused: str = ""
    """Non-empty: the request was refused (wrong token, other transport) and no session exists."""
    wire_version: int = WIRE_VERSION


def encode(msg: msgspec.Struct) -> bytes:
    return msgspec.msgpack.encode(msg)


def decode(data: bytes, kind: type[msgspec.Struct]):
    """Decode a message; anything malformed or of another wire version raises WeightSyncError."""
    try:
        msg = msgspec.msgpack.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise WeightSyncError(f"malformed {kind.__name__}: {e}") from e
    if msg.wire_version != WIRE_VERSION:
        raise WeightSyncError(f"{kind.__name__} has wire version {msg.wire_version}, expected {WIRE_VERSION}")
    return msg


class Keys:
    """Key names inside the rendezvous TCPStore.

    A broadcast receiver blocks on the key of its next manifest; writing `ENDED + reason` there
    instead of a manifest ends the session (the learner dropping it, or the receiver's own close).
    cuda-ipc sessions have a lock whose values are FREE / READER / WRITER / DROPPED."""

    ENDED = b"\x00ended:"
    FREE, READER, WRITER, DROPPED = b"free", b"reader", b"writer", b"dropped"
    JOIN_SEQ = "join/seq"

    @staticmethod
    def join(ticket: int) -> str:
        return f"join/{ticket}"

    @staticmethod
    def accept(ticket: int) -> str:
        return f"join/{ticket}/accept"

    @staticmethod
    def group(session: int) -> str:
        """PrefixStore prefix of the session's process-group rendezvous (broadcast)."""
        return f"s/{session}/pg/"

    @staticmethod
    def manifest(session: int, transfer: int) -> str:
        """broadcast: the manifest of the session's transfer number `transfer`."""
        return f"s/{session}/x/{transfer}"

    @staticmethod
    def served(session: int) -> str:
        """The version the generator serves (written by the receiver)."""
        return f"s/{session}/served"

    @staticmethod
    def lock(session: int) -> str:
        """cuda-ipc: who may touch the shared buffer now."""
        return f"s/{session}/lock"

    @staticmethod
    def version(session: int) -> str:
        """cuda-ipc: the version in the shared buffer."""
        return f"s/{session}/version"

    @staticmethod
    def layout(session: int) -> str:
        """cuda-ipc: the buffer's `IpcLayout` (IPC handle + manifest), written for admitted sessions only."""
        return f"s/{session}/layout"

    @staticmethod
    def layout_id(session: int) -> str:
        return f"s/{session}/layout_id"


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise WeightSyncError(f"unsupported dtype {name!r} (known: {sorted(_DTYPES)})") from None


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    dtype_from_name(name)
    return name
