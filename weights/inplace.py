"""Copying a whole version in place: the learner's pack into the shared buffer, the worker's apply out of it.

Both sides of a cuda-ipc sync copy every tensor of the model once per version, so how the copies are
issued, and what is looked up again each time, decides most of a sync's time beyond the bytes:

  copy_all(dsts, srcs)   tensors of at least `BIG_BYTES` one `copy_` each (a device memcpy at full
                         bandwidth), all smaller ones in one `torch._foreach_copy_` (one launch for many
                         tensors); a single foreach over every tensor moves the big ones more slowly, one
                         copy_ per small tensor pays a launch each.
  Slots(model, names)    where each named tensor of a module tree lives (its module's `_parameters` or
                         `_buffers` dict and key), resolved once; `read()` returns the tensors in those
                         places now, so a tensor that was replaced (FSDP2 swapping shards in, a reload
                         re-creating a parameter) is still found, without walking the module tree per
                         sync. The module tree itself is read once per `Slots`: a model whose submodules
                         are replaced needs new `Slots` (the callers key them on the model object).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

BIG_BYTES = 8 * 2**20
"""Tensors of at least this many bytes are copied one by one, the rest in one foreach copy."""


def copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], big_bytes: int = BIG_BYTES) -> None:
    """`dst.copy_(src)` for every pair, issued as few launches as keep the device's copy bandwidth;
    asynchronous on CUDA like `copy_`. Shapes must be equal (checked before anything is written); a dtype
    cast is allowed."""
    if len(dsts) != len(srcs):
        raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources")
    for d, s in zip(dsts, srcs):  # every shape before the first write
        if d.shape != s.shape:
            raise ValueError(f"copy of shape {tuple(s.shape)} into {tuple(d.shape)}")
    small_d, small_s = [], []
    with torch.no_grad():
        for d, s in zip(dsts, srcs):
            if d.numel() * d.element_size() >= big_bytes:
                d.copy_(s)
            else:
                small_d.append(d)
                small_s.append(s)
        if small_d:
            torch._foreach_copy_(small_d, small_s)


class Slots:
    """The places of named tensors in a module tree (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, names: Sequence[str]):
        self.model = model
        self.names = list(names)
        self._places = [self._place(model, name) for name in self.names]

    @staticmethod
    def _place(model: torch.nn.Module, name: str) -> tuple[dict, str]:
        prefix, _, leaf = name.rpartition(".")
        module = model.get_submodule(prefix)
        for table in (module._parameters, module._buffers):
            if table.get(leaf) is not None:
                return table, leaf
        raise KeyError(f"{name!r} is neither a parameter nor a buffer of {type(module).__name__}")

    def read(self) -> list[torch.Tensor]:
        """The tensors in their places now; KeyError if one was removed (the tree changed: build anew)."""
        out = [table.get(leaf) for table, leaf in self._places]
        if any(t is None for t in out):
            missing = [n for n, t in zip(self.names, out) if t is None]
            raise KeyError(f"tensors removed from the model: {missing[:3]}")
        return out
