"""Fixtures of the weight-sync tests."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from weights import ipc
from weights.ipc import IpcHandle, MappingCache


@pytest.fixture
def fake_ipc(monkeypatch):
    """share() remembers the buffer; mapping any handle returns that same tensor (one process, no CUDA)."""
    buffers = {}

    def share(tensor):
        buffers["b"] = tensor
        return IpcHandle(0, b"h", tensor.numel(), 0, b"r", 0, b"e", False)

    monkeypatch.setattr(ipc, "share", share)
    monkeypatch.setattr(ipc, "LOCAL_MAPPINGS", MappingCache(lambda h, n: buffers["b"]))
    return buffers


@pytest.fixture
def checkpoint(tmp_path):
    """A three-tensor model.safetensors in tmp_path: (its directory, the tensors)."""
    disk = {"a.weight": torch.zeros(2, 3), "b.weight": torch.ones(4), "c.weight": torch.full((3,), 2.0)}
    save_file(disk, str(tmp_path / "model.safetensors"))
    return tmp_path, disk
