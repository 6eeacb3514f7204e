"""CPU checks of policy/checkpointing.py: full, selective and no activation checkpointing give the same gradients."""

from __future__ import annotations

import pytest
import torch

from bench.gpu_models import build_model, qwen_config, synthetic_samples
from policy.checkpointing import apply_checkpointing, parse_mode
from policy.forward import PackedPolicy
from policy.packing import pack


@pytest.fixture(scope="module")
def tiny():
    config = qwen_config("tiny")
    model = build_model(config, "cpu", torch.float32, seed=1)
    samples = synthetic_samples(config, n=3, seed=2, text_tokens=12, image_side=112, response=(3, 9))
    return model, samples


def test_checkpointing_modes_keep_gradients(tiny):
    model, samples = tiny
    batch = pack(samples, model.config.image_token_id)
    policy = PackedPolicy(model).train()
    grads = {}
    for mode in ("none", "full", "selective"):
        apply_checkpointing(model, text=mode, vision=mode)
        model.zero_grad(set_to_none=True)
        logprobs, _ = policy(batch)
        logprobs.sum().backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(grads["full"], grads["none"], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grads["selective"], grads["none"], rtol=1e-4, atol=1e-6)


def test_parse_mode():
    assert parse_mode("selective:2", 3) == ["selective", "selective", "full"]
    assert parse_mode("none", 2) == ["none", "none"]
    with pytest.raises(ValueError):
        parse_mode("partial", 2)
    with pytest.raises(ValueError):
        parse_mode("selective:4", 3)


def test_compiled_blocks_give_the_same_logprobs_and_gradients(tiny_processor, tiny_model):
    import copy

    from policy.checkpointing import apply_checkpointing
    from policy.compile import compile_blocks
    from policy.forward import PackedPolicy
    from policy.packing import pack
    from tests.fixtures.models import make_samples

    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = pack(make_samples(tiny_processor, (1, 0), seed=4), pad)
    model = copy.deepcopy(tiny_model).train()
    apply_checkpointing(model, "selective", "full")
    policy = PackedPolicy(model, chunk_size=16)

    def run():
        model.zero_grad(set_to_none=True)
        lp, ent = policy(batch)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), model.model.language_model.layers[0].mlp.up_proj.weight.grad.clone()

    eager = run()
    assert compile_blocks(model) == len(model.model.language_model.layers)
    compiled = run()
    assert (compiled[0] - eager[0]).abs().max() <= 1e-5
    assert (compiled[1] - eager[1]).abs().max() <= 1e-5 and eager[1].abs().max() > 0
