"""On one GPU the KL reference model in host memory (learner/reference.py, FSDP2's CPU offload) scores as the
same model on the GPU does, holding only its root and the blocks in flight on the device."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("compile_mode", ["", "elementwise"])
def test_reference_in_host_memory_scores_like_the_reference_on_the_gpu(compile_mode):
    """Eager: bit for bit. Compiled elementwise (the learner's default) on both sides: the same fused kernels,
    though inductor may specialise them differently for the gathered weights' alignment, so within 1e-3."""
    from learner.parallel import init_distributed
    from learner.reference import offload_to_host
    from policy.builder import build_model
    from policy.compile import apply_compile
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
    gpu_model = copy.deepcopy(cpu_model).to("cuda").eval()
    if compile_mode:
        apply_compile(gpu_model, compile_mode)
    on_gpu = PackedPolicy(gpu_model, compile_logprobs=bool(compile_mode))
    with torch.no_grad():
        want, _ = on_gpu(batch)
    del on_gpu
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    ref = offload_to_host(cpu_model, info.device, compile_mode=compile_mode)
    shard = next(p for n, p in ref.named_parameters() if "layers.0.mlp.up_proj" in n).to_local()
    assert shard.device.type == "cpu" and shard.is_pinned()  # its memory map page-locked (cudaHostRegister)
    with torch.no_grad():
        got, _ = ref(batch)
        again, _ = ref(batch)
    tol = 1e-3 if compile_mode else 0.0
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    torch.testing.assert_close(again, got, rtol=0, atol=0)
    total = sum(p.numel() * 2 for p in ref.parameters())
    blocks = sum(p.numel() * 2 for n, p in ref.named_parameters() if ".layers." in n)
    # the root (embeddings, lm_head) may stay gathered; the decoder blocks went back to host memory
    assert torch.cuda.memory_allocated() - before < total - blocks // 2


def test_host_memory_around_the_page_locked_reference_stays_usable():
    """A second learner in one process (bench.learner_step's variants) must copy from the GPU into new host
    memory: page-locking heap pages in place would lock the neighbours that share them, and a copy into those
    fails (cudaErrorInvalidValue). The reference lives in a memory map of its own, unregistered when it is
    collected: host tensors around it and a second reference after it copy as any others."""
    import gc

    from learner.parallel import init_distributed
    from learner.reference import offload_to_host
    from policy.builder import build_model

    info = init_distributed()
    sizes = [1 << 10, 3 << 12, 5 << 16, 7 << 18, 3 << 21, 5 << 22]  # 1 KB to 20 MB, heap and mapped
    for _ in range(2):  # the second reference comes after the first is collected
        churn = [torch.empty(64 << 20, dtype=torch.uint8) for _ in range(3)]  # raises glibc's mmap threshold
        del churn
        ref = offload_to_host(
            build_model("tiny-fullvocab", "cpu", torch.bfloat16, seed=0).requires_grad_(False), info.device
        )
        for size in sizes * 4:
            src = torch.arange(size, device=info.device, dtype=torch.int32)
            host = src.to("cpu")  # device to host into a fresh allocation
            assert int(host[-1]) == size - 1
            assert int(host.to(info.device)[size // 2]) == size // 2
        del ref
        gc.collect()
