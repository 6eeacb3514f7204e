"""CUDA-IPC weights into a vLLM engine whose core runs in its own process (the default on CUDA).

The learner side (IpcWeightSender, this process) shares its buffer; the engine's front end (also this
process) passes only the reference; vLLM's worker (the engine-core process) maps the buffer and loads
from it. Checked: the served weights equal the learner's (fp64 sums per layer, read inside the worker),
greedy output (tokens and their logprobs) follows the weights, the front end never maps the buffer, the worker maps it once across
syncs, and the bytes fallback (named tensors from the checkpoint) restores the original output.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _opened_in_worker(worker) -> int:
    from generator import weights

    return weights.LOCAL_MAPPINGS.opened


def test_ipc_versions_reach_a_multi_process_engine(tmp_path):
    from safetensors.torch import load_file

    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine
    from generator.inputs import Request
    from policy.builder import build_checkpoint, build_model
    from policy.weight_ipc import IpcSenderConfig, IpcWeightReceiver, IpcWeightSender
    from tasks.prompt import render_prompt_ids
    from tests.fixtures.weight_sums import layer_sums, layer_sums_in_worker

    ckpt = build_checkpoint("tiny-fullvocab", seed=0, out=tmp_path / "ckpt", device="cuda")
    torch.cuda.empty_cache()
    engine = Engine(
        ckpt,
        EngineConfig(
            enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=1024, keep_rollback_copy=False
        ),
        SamplingConfig(max_tokens=16, eval_temperature=0.0),
        run_dir=tmp_path / "run",
    )
    sender = None
    try:
        assert not engine.in_process
        request = Request(render_prompt_ids(engine.tokenizer, "Count to ten.", 0), [], split="test")

        def greedy():  # a tiny random model often repeats one token: its logprobs still follow the weights
            (result,) = engine.generate([request])
            return result.completions[0].token_ids, result.completions[0].logprobs

        def same(a, b):
            return a[0] == b[0] and all(abs(x - y) <= 1e-3 for x, y in zip(a[1], b[1]))

        def served_sums():
            return engine._llm.collective_rpc(layer_sums_in_worker)[0]

        def close(a, b):
            return set(a) == set(b) and all(abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(a[k])) for k in a)

        original = greedy()
        model = build_model("tiny-fullvocab", "cuda", torch.bfloat16, seed=1)
        sender = IpcWeightSender(IpcSenderConfig(dtype="bfloat16"))
        receiver = IpcWeightReceiver("gpu-engine", sender.start())
        assert receiver.take() is None  # registers
        outputs = []
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-1.0)
            sender.sync(model, version=version)
            got = receiver.take()
            assert got is not None and got.version == version
            engine.apply_weights(got, version)
            receiver.mark_served(version)
            assert engine.version == version
            assert receiver._buffer is None  # the front end never mapped the learner's buffer
            assert close(layer_sums(model), served_sums())
            outputs.append(greedy())
        assert not same(outputs[0], original) and not same(outputs[1], outputs[0])
        assert engine._llm.collective_rpc(_opened_in_worker)[0] == 1  # mapped once, reused by version 2
        assert sender.members() == {"gpu-engine": 2}
        engine.apply_weights(load_file(str(ckpt / "model.safetensors")).items(), version=0)  # bytes fallback
        assert same(greedy(), original)
    finally:
        engine.close()
        if sender is not None:
            sender.close()
