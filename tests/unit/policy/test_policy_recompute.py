"""CPU checks of policy/recompute.py: full, selective and no recomputation give the same gradients."""

from __future__ import annotations

import pytest
import torch

from policy.builder import build_model
from policy.forward import PackedPolicy
from policy.packing import pack
from policy.presets import model_config
from policy.recompute import apply_recompute, parse_mode
from policy.synthetic import synthetic_samples


@pytest.fixture(scope="module")
def tiny():
    config = model_config("tiny-fullvocab")
    model = build_model("tiny-fullvocab", "cpu", torch.float32, seed=1)
    samples = synthetic_samples(config, n=3, seed=2, text_tokens=12, image_side=112, response=(3, 9))
    return model, samples


def test_recompute_modes_keep_gradients(tiny):
    model, samples = tiny
    batch = pack(samples, model.config.image_token_id)
    policy = PackedPolicy(model).train()
    grads = {}
    for mode in ("none", "full", "selective"):
        apply_recompute(model, text=mode, vision=mode)
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


@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("mode", ["elementwise", "blocks"])
def test_compiled_models_give_the_same_logprobs_and_gradients(tiny_processor, tiny_model, mode, recompute):
    import copy

    from policy.compile import apply_compile
    from tests.fixtures.models import make_samples

    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = pack(make_samples(tiny_processor, (1, 0), seed=4), pad)
    model = copy.deepcopy(tiny_model).train()
    apply_recompute(model, recompute, "full")
    policy = PackedPolicy(model, chunk_size=16)

    def run():
        model.zero_grad(set_to_none=True)
        lp, ent = policy(batch)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), model.model.language_model.layers[0].mlp.up_proj.weight.grad.clone()

    eager = run()
    n = apply_compile(model, mode)
    layers = len(model.model.language_model.layers)
    assert (
        n == layers if mode == "blocks" else n > 3 * layers
    )  # two norms and an MLP per decoder block, + vision
    policy.compile_logprobs = mode == "elementwise"
    compiled = run()
    for a, b in zip(compiled, eager):
        assert (a - b).abs().max() <= 1e-5
    assert eager[2].abs().max() > 0
    with pytest.raises(ValueError, match="compile mode"):
        apply_compile(model, "everything")
