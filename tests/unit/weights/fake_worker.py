"""A fake vLLM engine for the WeightLoader tests (weights/vllm_apply.py), so they run without vLLM or CUDA.

`FakeModel` is what the loader reaches inside a worker (model_runner.reload_weights, model.load_weights);
`FakeLLM` an in-process engine's collective_rpc; `ProcessLLM` a multi-process one's, where every argument
crosses msgpack. `shared(tensors)` packs a learner-side cuda-ipc buffer (a CPU tensor, a fake handle) and
`ipc_version(layout)` is the version a receiver hands over for it.
"""

from __future__ import annotations

import functools

import msgspec
import torch
from safetensors.torch import load

from weights import ipc
from weights.interface import ReceivedVersion
from weights.ipc import IpcHandle, IpcLayout
from weights.manifest import pack_bucket, plan_layout
from weights.protocol import Manifest
from weights.vllm_worker import WorkerExtension


class FakeModel:
    """What the loader reaches inside vLLM's worker: model_runner.reload_weights / model.load_weights."""

    def __init__(self, disk: dict[str, torch.Tensor]):
        self.disk = disk
        self.params = {k: v.clone() for k, v in disk.items()}
        self.fail_after: int | None = None
        """Raise after writing this many tensors of the next load (then load normally again)."""
        self.loads = 0

    def parameters(self):
        return iter(self.params.values())

    def load_weights(self, weights):
        self.loads += 1
        for i, (name, tensor) in enumerate(weights):
            if self.fail_after is not None and i == self.fail_after:
                self.fail_after = None
                raise RuntimeError("boom half way")
            self.params[name].copy_(tensor)

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        assert is_checkpoint_format
        self.load_weights(weights_iterator if weights_iterator is not None else iter(self.disk.items()))


class FakeWorker(WorkerExtension):
    """vLLM's worker with Parallax's extension mixed in (what `worker_extension_cls` makes of it)."""

    def __init__(self, model: FakeModel):
        self.model_runner = model


class FakeLLM:
    """An in-process engine: collective_rpc runs the named worker method (or `fn(worker, ...)`)."""

    def __init__(self, model: FakeModel):
        self.worker = FakeWorker(model)
        model.model = model

    def collective_rpc(self, fn, args=(), kwargs=None):
        call = getattr(self.worker, fn) if isinstance(fn, str) else functools.partial(fn, self.worker)
        return [call(*args, **(kwargs or {}))]


class ProcessLLM(FakeLLM):
    """A multi-process engine: every RPC's arguments cross msgpack (plain data only). Records each RPC's
    wire size (`sent`) and the tensor bytes of each safetensors blob (`chunks`), and can fail half way
    through the `fail_rpc`-th blob (counting from 0)."""

    def __init__(self, model: FakeModel):
        super().__init__(model)
        self.sent: list[int] = []
        self.chunks: list[dict[str, int]] = []
        self.fail_rpc: int | None = None

    def collective_rpc(self, fn, args=(), kwargs=None):
        assert isinstance(fn, str), f"a multi-process engine takes method names, not {fn!r} (pickle)"
        wire = msgspec.msgpack.encode(list(args))
        self.sent.append(len(wire))
        args = msgspec.msgpack.decode(wire)
        if fn == "parallax_load_bytes":  # a safetensors blob (a cuda-ipc layout is bytes too)
            if self.fail_rpc == len(self.chunks):
                self.worker.model_runner.fail_after = 1
            self.chunks.append({k: v.numel() * v.element_size() for k, v in load(args[0]).items()})
        return super().collective_rpc(fn, args, kwargs)


def shared(tensors: dict[str, torch.Tensor], layout_id: int = 1, handle: bytes = b"h1"):
    """A learner-side buffer holding `tensors` and its IpcLayout (the handle is fake)."""
    plan = plan_layout([(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()], 1 << 40)  # one buffer
    buffer = torch.zeros(plan.bucket_nbytes[0], dtype=torch.uint8)
    pack_bucket(buffer, plan.tensors, tensors.values())
    manifest = Manifest(version=-1, tensors=plan.tensors, bucket_nbytes=plan.bucket_nbytes, checksums=False)
    handle = IpcHandle(0, handle, buffer.numel(), 0, b"r", 0, b"e", False)
    return buffer, IpcLayout(layout_id=layout_id, nbytes=buffer.numel(), handle=handle, manifest=manifest)


def ipc_version(layout: IpcLayout, version: int = 1) -> ReceivedVersion:
    """A cuda-ipc version as a receiver hands it over, mapping through this process's cache."""
    return ReceivedVersion(layout.manifest, lambda: [ipc.mapping(layout)], ipc=layout, version=version)
