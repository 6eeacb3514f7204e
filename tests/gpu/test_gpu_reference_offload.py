"""On one GPU the KL reference model in host memory (learner/reference.py, FSDP2's CPU offload) scores as the
same model on the GPU does, holding only its root and the blocks in flight on the device."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_reference_in_host_memory_scores_like_the_reference_on_the_gpu():
    from learner.parallel import init_distributed
    from learner.reference import offload_to_host
    from policy.builder import build_model
    from policy.forward import PackedPolicy
    from policy.packing import pack
    from policy.presets import model_config
    from policy.synthetic import synthetic_samples

    info = init_distributed()
    config = model_config("tiny-fullvocab")
    samples = synthetic_samples(
        config, n=6, seed=3, text_tokens=24, image_side=224, response=(20, 60), group_size=3
    )
    batch = pack(samples, config.image_token_id).to("cuda")
    # one set of weights for both (built on the GPU, the CUDA generator would draw other ones)
    cpu_model = build_model("tiny-fullvocab", "cpu", torch.bfloat16, seed=0).requires_grad_(False)
    on_gpu = PackedPolicy(copy.deepcopy(cpu_model).to("cuda").eval())
    with torch.no_grad():
        want, _ = on_gpu(batch)
    del on_gpu
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    ref = offload_to_host(cpu_model, info.device)
    shard = next(p for n, p in ref.named_parameters() if "layers.0.mlp.up_proj" in n).to_local()
    assert shard.device.type == "cpu" and shard.is_pinned()  # page-locked in place (cudaHostRegister)
    with torch.no_grad():
        got, _ = ref(batch)
        again, _ = ref(batch)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(again, want, rtol=0, atol=0)
    total = sum(p.numel() * 2 for p in ref.parameters())
    blocks = sum(p.numel() * 2 for n, p in ref.named_parameters() if ".layers." in n)
    # the root (embeddings, lm_head) may stay gathered; the decoder blocks went back to host memory
    assert torch.cuda.memory_allocated() - before < total - blocks // 2
