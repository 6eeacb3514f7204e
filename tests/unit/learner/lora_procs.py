"""A two-rank FSDP2 (gloo) LoRA learner step, run in spawned processes by test_lora.py."""

from __future__ import annotations

import torch


def lora_step(model_dir: str, out: str, rank: int = 0, world: int = 1, port: int = 0) -> None:
    """Adapt the tiny model (seeded), shard it when `world` > 1, train one AdamW step on a packed batch of
    fixed samples, export the adapter (PEFT format) into `out` (rank 0)."""
    import torch.distributed as dist

    from learner.config import ParallelConfig
    from learner.lora import add_adapter, export_adapter
    from learner.lora_config import LoraConfig
    from learner.parallel import apply_parallelism
    from policy.loading import load_model, load_processor
    from policy.packing import pack
    from tests.fixtures.models import make_samples

    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = load_model(model_dir)
    add_adapter(model, LoraConfig(rank=4, alpha=8.0), base_path=model_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.linspace(-0.05, 0.05, p.numel()).reshape(p.shape))
    model.train()
    root = apply_parallelism(model, ParallelConfig(activation_checkpointing=True), torch.device("cpu"))
    params = [p for p in root.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    processor = load_processor(model_dir)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = pack(make_samples(processor, (1, 0, 1)), pad)
    logprobs, _ = root(batch, run_vision_always=True)
    (-logprobs.mean()).backward()
    optimizer.step()
    export_adapter(root, model, out, rank)
    if world > 1:
        dist.destroy_process_group()
