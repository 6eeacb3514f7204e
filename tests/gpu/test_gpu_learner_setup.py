"""On one GPU the learner's model setup (one-rank FSDP2, bf16 mixed precision, selective AC, elementwise
compile,
images once per group) trains: gradients reach the fp32 master shards and match an eager bf16 reference."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_single_gpu_learner_setup_is_fsdp_bf16_and_correct():
    import torch.distributed as dist

    from learner.config import ParallelConfig
    from learner.parallel import apply_parallelism, init_distributed
    from policy.builder import build_model
    from policy.forward import PackedPolicy
    from policy.packing import pack
    from policy.presets import model_config
    from policy.synthetic import synthetic_samples

    info = init_distributed()
    assert dist.is_initialized() and dist.get_world_size() == 1 and info.device.type == "cuda"
    config = model_config("tiny-fullvocab")
    samples = synthetic_samples(
        config, n=6, seed=3, text_tokens=24, image_side=224, response=(20, 60), group_size=3
    )
    batch = pack(samples, config.image_token_id).to("cuda")
    assert batch.image_index is not None and batch.image_grid_thw.shape[0] == 2  # two groups, two encodes

    ref_model = build_model("tiny-fullvocab", "cuda", torch.bfloat16, seed=0).train()
    ref_lp, _ = PackedPolicy(ref_model)(batch)
    model = build_model("tiny-fullvocab", "cuda", torch.float32, seed=0).train()
    root = apply_parallelism(
        model, ParallelConfig(checkpoint_mode="selective", compile="elementwise"), info.device
    )
    lp, entropy = root(batch)
    lp.sum().backward()
    param = next(p for n, p in root.named_parameters() if "layers.0.mlp.up_proj" in n)
    assert type(param).__name__ == "DTensor" and param.dtype == torch.float32
    assert param.grad is not None and torch.isfinite(param.grad.full_tensor()).all()
    assert (lp.detach() - ref_lp.detach()).abs().max() < 0.1  # bf16 compute in both
    assert torch.isfinite(entropy).all()
