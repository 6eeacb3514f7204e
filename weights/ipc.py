"""CUDA IPC plumbing of the `cuda-ipc` transport: share a buffer, map it in another process, once.

`share(tensor)` turns a CUDA tensor's storage into an `IpcHandle` (plain fields, no pickle);
`open_shared(handle, nbytes)` maps it in another process. `IpcLayout` is what a generator gets: the
handle, the buffer's size and the `Manifest` that places every tensor in it (~100 KB for 7B).
`MappingCache` keeps the buffer of the newest layout mapped (`LOCAL_MAPPINGS`: one per process,
used by the receiver and by vLLM's worker alike); a new layout drops the old mapping first, so the
learner can free a buffer it re-allocated. Only CUDA tensors can be shared.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch

from weights.protocol import Manifest, WeightSyncError


class IpcHandle(msgspec.Struct, frozen=True):
    """What `torch.UntypedStorage._share_cuda_()` returns, as plain fields."""

    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class IpcLayout(msgspec.Struct, kw_only=True):
    """The shared buffer: its handle, size and the manifest that places every tensor in it."""

    layout_id: int
    """Changes whenever the learner allocates a new buffer."""
    nbytes: int
    handle: IpcHandle
    manifest: Manifest


def share(tensor: torch.Tensor) -> IpcHandle:
    """The IPC handle of `tensor`'s storage (the tensor must stay alive while anyone maps it)."""
    if not tensor.is_cuda:
        raise WeightSyncError("CUDA IPC needs a CUDA tensor")
    fields = tensor.untyped_storage()._share_cuda_()
    return IpcHandle(
        int(fields[0]),
        bytes(fields[1]),
        int(fields[2]),
        int(fields[3]),
        bytes(fields[4]),
        int(fields[5]),
        bytes(fields[6]),
        bool(fields[7]),
    )


def open_shared(h: IpcHandle, nbytes: int) -> torch.Tensor:
    """A uint8 view of another process's shared buffer (mapped into this process)."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        h.device,
        h.handle,
        h.storage_bytes,
        h.storage_offset,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{h.device}").set_(storage, 0, (nbytes,), (1,))


class MappingCache:
    """The shared buffer of the newest layout, mapped once; a new layout (the learner re-allocated, or a
    new learner) drops the old mapping first, so the old buffer can be freed on the learner's side."""

    def __init__(self, opener: Callable[[IpcHandle, int], torch.Tensor] | None = None):
        self._opener = opener
        self._key: tuple | None = None
        self._buffer: torch.Tensor | None = None
        self.opened = 0

    def get(self, layout: IpcLayout, device: int | None = None) -> torch.Tensor:
        """The buffer of `layout`, mapped on `device` (default: the handle's own device index)."""
        handle = layout.handle
        if device is not None and device != handle.device:
            handle = msgspec.structs.replace(handle, device=device)
        key = (layout.layout_id, layout.nbytes, handle.handle, handle.device)
        if key != self._key:
            self.release()
            opener = self._opener or open_shared
            self._buffer = opener(handle, layout.nbytes)
            self._key = key
            self.opened += 1
        return self._buffer

    @property
    def mapped(self) -> torch.Tensor | None:
        return self._buffer

    def release(self) -> None:
        self._key, self._buffer = None, None


LOCAL_MAPPINGS = MappingCache()
"""This process's mapping of the learner's buffer (the receiver's, and the worker's in vLLM's engine core)."""


def mapping(layout: IpcLayout, device: int | None = None) -> torch.Tensor:
    """`LOCAL_MAPPINGS.get` looked up at call time (tests replace the module's cache)."""
    return LOCAL_MAPPINGS.get(layout, device)
