"""CUDA-IPC weights into a vLLM engine whose core runs in its own process (the default on CUDA), in
checkpoint layout and in vLLM's layout (one fused copy per parameter inside the worker).

The learner side (the cuda-ipc sender, this process) shares its buffer; the engine's front end (also this
process) passes only the reference; vLLM's worker (the engine-core process) maps the buffer and loads
from it. Checked: the served weights equal the learner's (fp64 sums per layer, read inside the worker),
greedy output (tokens and their logprobs) follows the weights, the front end never maps the buffer,
the worker maps it once across syncs, and the bytes fallback (named tensors from the checkpoint)
restores the original output.
"""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.vllm,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("layout", ["checkpoint", "vllm"])
def test_ipc_versions_reach_a_multi_process_engine(tmp_path, layout):
    from safetensors.torch import load_file

    import weights
    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine
    from generator.inputs import Request
    from policy.builder import build_checkpoint, build_model
    from tasks.prompt import render_prompt_ids
    from weights import ipc
    from weights.config import CudaIpcTransport, WeightReceiverConfig, WeightSenderConfig
    from weights.fingerprint import layer_sums

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
    sender = receiver = None
    try:
        assert not engine.in_process
        request = Request(render_prompt_ids(engine.tokenizer, "Count to ten.", 0), [], split="test")

        def greedy():  # a tiny random model often repeats one token: its logprobs still follow the weights
            (result,) = engine.generate([request])
            return result.completions[0].token_ids, result.completions[0].logprobs

        def same(a, b):
            return a[0] == b[0] and all(abs(x - y) <= 1e-3 for x, y in zip(a[1], b[1]))

        def served_sums():
            return engine.run_in_worker("parallax_layer_sums")[0]

        def close(a, b):
            return set(a) == set(b) and all(abs(a[k] - b[k]) <= 1e-6 * max(1.0, abs(a[k])) for k in a)

        original = greedy()
        model = build_model("tiny-fullvocab", "cuda", torch.bfloat16, seed=1)
        sender = weights.sender(
            WeightSenderConfig(transport=CudaIpcTransport(), send_dtype="bfloat16", layout=layout),
            device="cuda",
        )
        a = sender.start()
        cfg = WeightReceiverConfig(transport=a.transport, address=a.address, token=a.token)
        receiver = weights.receiver(cfg, "gpu-engine", device="cuda").start()
        deadline = time.monotonic() + 30
        while "gpu-engine" not in sender.members() and time.monotonic() < deadline:
            time.sleep(0.01)
        outputs = []
        for version in (1, 2):
            if version == 2:
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(-1.0)
            sender.sync(model, version=version)
            got = receiver.poll()
            assert got is not None and got.version == version
            engine.apply_weights(got, version)
            receiver.mark_served(version)
            assert engine.version == version
            assert ipc.LOCAL_MAPPINGS.mapped is None  # the front end never mapped the learner's buffer
            assert close(layer_sums(model), served_sums())
            outputs.append(greedy())
        assert not same(outputs[0], original) and not same(outputs[1], outputs[0])
        assert (
            engine.run_in_worker("parallax_ipc_mappings_opened")[0] == 1
        )  # mapped once, reused by version 2
        assert sender.members() == {"gpu-engine": 2}
        engine.apply_weights(load_file(str(ckpt / "model.safetensors")).items(), version=0)  # bytes fallback
        assert same(greedy(), original)
    finally:
        engine.close()
        if receiver is not None:
            receiver.close()
        if sender is not None:
            sender.close()
