"""On CUDA, the packed forward (varlen attention, text and vision) matches the padded SDPA forward in bf16,
for both model families (Qwen2.5-VL, Qwen3-VL)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("preset", ["tiny-fullvocab", "qwen3-vl-tiny-fullvocab"])
def test_packed_matches_padded_bf16(preset):
    from policy.builder import build_model
    from policy.forward import PackedPolicy, attention_backend
    from policy.packing import pack
    from policy.presets import model_config
    from policy.synthetic import padded_batch, padded_logprobs, synthetic_samples, use_sdpa

    config = model_config(preset)
    model = build_model(preset, "cuda", torch.bfloat16, seed=0).eval()
    samples = synthetic_samples(config, n=4, seed=3, text_tokens=24, image_side=224, response=(20, 60))
    with torch.no_grad():
        use_sdpa(model)
        ref = padded_logprobs(model, padded_batch(samples, config, "cuda"))
        policy = PackedPolicy(model)
        batch = pack(samples, config.image_token_id).to("cuda")
        assert attention_backend(torch.zeros(1, device="cuda", dtype=torch.bfloat16)) != "sdpa_loop"
        got, entropy = policy(batch)
    assert got.shape == ref.shape and torch.isfinite(got).all() and torch.isfinite(entropy).all()
    assert (got - ref.float()).abs().max() < 0.1  # bf16 forward, fp32 log-softmax
    assert (got - ref.float()).abs().mean() < 0.02


@pytest.mark.parametrize("preset", ["tiny-fullvocab", "qwen3-vl-tiny-fullvocab"])
def test_shared_prompts_match_unshared_bf16(preset):
    """The GPU kernel's causal alignment with more keys than queries (flash-attn's varlen, or torch's) is at
    the end, as the shared-prompt row needs: a start-aligned mask would let a response see only the first
    tokens of its prompt, and its logprobs would be far from the unshared row's (on these samples, mean 0.13:
    tests/unit/policy/test_policy_shared_prompts.py checks that on CPU with the same model and samples)."""
    from policy.builder import build_model
    from policy.forward import PackedPolicy
    from policy.packing import pack
    from policy.presets import model_config
    from policy.synthetic import synthetic_samples

    config = model_config(preset)
    model = build_model(preset, "cuda", torch.bfloat16, seed=0).eval()
    samples = synthetic_samples(
        config, n=8, seed=5, text_tokens=24, image_side=224, response=(20, 60), group_size=4
    )
    with torch.no_grad():
        policy = PackedPolicy(model)
        plain = pack(samples, config.image_token_id).to("cuda")
        shared = pack(samples, config.image_token_id, share_prompts=True).to("cuda")
        assert shared.num_tokens < plain.num_tokens
        (a, _), (b, _) = policy(plain), policy(shared)
    assert torch.isfinite(b).all()
    assert (a - b).abs().max() < 0.1 and (a - b).abs().mean() < 0.01  # bf16 kernels, fp32 log-softmax
