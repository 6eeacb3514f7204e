"""Distributed setup, FSDP2 sharding, the optimizer and gradient clipping of the learner.

Parallelism is applied in torchtitan's fixed order: activation checkpointing first (the
model's own non-reentrant per-block checkpointing, which keeps parameter names unchanged for
weight sync and export), then `fully_shard` per vision block, the vision tower, per decoder
block, and last the root (embeddings, final norm, lm_head). bf16 parameters with fp32
gradient reduction on GPU; fp32 on CPU. Without an initialised process group the model stays
a plain module (one process, no sharding).

FSDP's collectives must happen in the same order on every rank: `vision_dummy_loss` runs the
vision tower on a 4-patch dummy image, times zero, for a micro-batch without images (workload
pitfall 5), and every rank runs the same number of micro-batches (`agree_max`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from learner.config import OptimConfig, ParallelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the training group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(backend: str = "") -> DistInfo:
    """Join the torchrun-style group described by RANK/WORLD_SIZE/LOCAL_RANK (if any)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if "RANK" in os.environ and not dist.is_initialized():
        backend = backend or ("nccl" if cuda else "gloo")
        dist.init_process_group(backend=backend, device_id=device if cuda else None)
        log.info("rank %d/%d joined the %s group on %s", rank, world, backend, device)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def distributed() -> bool:
    """True when a process group is up (even with one rank)."""
    return dist.is_available() and dist.is_initialized()


class PolicyModule(nn.Module):
    """The root FSDP unit: holds the Hugging Face model and runs a forward function on it.

    FSDP2 gathers the root's own parameters (embeddings, final norm, lm_head) when the root's
    forward starts, so every forward must enter through here. `forward(fn, *args, vision_dummy=)`
    first runs `vision_dummy_loss` when asked (a micro-batch without images), then
    `fn(self.hf, *args, **kwargs)`, and returns (fn's output, the dummy zero or None).
    """

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, fn, *args, vision_dummy: bool = False, **kwargs):
        zero = vision_dummy_loss(self.hf) if vision_dummy else None
        return fn(self.hf, *args, **kwargs), zero


def apply_parallelism(model: nn.Module, cfg: ParallelConfig, device: torch.device) -> PolicyModule:
    """Activation checkpointing, then FSDP2 per block, vision tower and root; returns the root.

    `model` is the Hugging Face model; the returned `PolicyModule` wraps it (`.hf`), and its
    parameters keep their Hugging Face names under `.hf`.
    """
    if cfg.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    root = PolicyModule(model)
    if not distributed():
        return root
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if device.type == "cuda" and cfg.mixed_precision:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    kwargs = dict(mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    visual, layers = vision_tower(model), decoder_layers(model)
    if visual is not None:
        for block in visual.blocks:
            fully_shard(block, **kwargs)
        fully_shard(visual, **kwargs)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)  # root: embeddings, norm, lm_head
    return root


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision transformer of a Qwen2.5-VL model (None for a text-only model)."""
    inner = getattr(model, "model", model)
    return getattr(inner, "visual", None)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The language model's decoder blocks."""
    inner = getattr(model, "model", model)
    lm = getattr(inner, "language_model", inner)
    return lm.layers


def vision_dummy_loss(model: nn.Module) -> torch.Tensor:
    """Zero that depends on every vision parameter: run the tower on a 2x2-patch dummy image.

    Add it to the loss of a micro-batch without images, BEFORE the language model runs, so that
    every rank all-gathers the vision tower's FSDP units in the same order.
    """
    visual = vision_tower(model)
    if visual is None:
        return torch.zeros(())
    vcfg = visual.config
    patch_dim = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
    merge = vcfg.spatial_merge_size
    param = next(visual.parameters())
    pixels = torch.zeros(merge * merge, patch_dim, dtype=torch.float32, device=param.device)
    grid = torch.tensor([[1, merge, merge]], device=param.device)
    out = visual(pixels, grid_thw=grid)
    hidden = getattr(out, "pooler_output", None)
    hidden = out[0] if hidden is None else hidden
    return hidden.float().sum() * 0.0


def agree_max(value: int) -> int:
    """The maximum of `value` over all ranks (the value itself without a group)."""
    if not distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum of `values` over all ranks (fp64)."""
    if not distributed():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the trainable parameters, with linear warm-up then a constant rate."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=True
    )
    warmup = max(cfg.warmup_steps, 0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
    )
    return optimizer, scheduler


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Global L2 gradient norm (over all shards) before clipping; clips when max_norm > 0."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else math.inf, foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm.item())
