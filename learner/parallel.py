"""Distributed setup, FSDP2 sharding, the optimizer and gradient clipping of the learner.

Parallelism is applied in torchtitan's fixed order: activation checkpointing first (the
model's own non-reentrant per-block checkpointing, which keeps parameter names unchanged for
weight sync and export), then `fully_shard` per vision block, the vision tower, per decoder
block, and last the root (embeddings, final norm, lm_head). bf16 parameters with fp32
gradient reduction on GPU; fp32 on CPU. Without an initialised process group the model stays
a plain module (one process, no sharding).

The root is `policy.forward.PackedPolicy`, so that the root's hooks gather the embeddings and
lm_head for every packed forward. FSDP's collectives must happen in the same order on every
rank: the forward runs with `run_vision_always=True` (a micro-batch without images runs the
vision tower on a dummy image, times zero: workload pitfall 5), and every rank runs the same
number of micro-batches (`agree_max`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from learner.config import OptimConfig, ParallelConfig
from policy.forward import PackedPolicy

log = logging.getLogger(__name__)

HF_PREFIX = "model."
"""Prefix of the Hugging Face model's parameter names inside the training root (`PackedPolicy.model`)."""


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
    if dist.is_initialized():
        pass
    elif "RANK" in os.environ:
        backend = backend or ("nccl" if cuda else "gloo")
        dist.init_process_group(backend=backend, device_id=device if cuda else None)
        log.info("rank %d/%d joined the %s group on %s", rank, world, backend, device)
    elif cuda:  # one GPU, no launcher: a one-rank group, so FSDP2's bf16 mixed precision applies
        from broker.redis_server import free_port

        dist.init_process_group(
            backend=backend or "nccl",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            device_id=device,
        )
        log.info("single-GPU learner: a one-rank %s group on %s", backend or "nccl", device)
    return DistInfo(rank=rank, world_size=world, local_rank=local_rank, device=device)


def distributed() -> bool:
    """True when a process group is up (even with one rank)."""
    return dist.is_available() and dist.is_initialized()


def text_checkpoint_mode(cfg: ParallelConfig) -> str:
    """The decoder blocks' recompute mode (policy/recompute.py `parse_mode`): the config's, "selective:<k>"
    for selective on the first k blocks, and "auto" (which the launcher's layout resolves before the learner
    starts) run as selective by a learner started on its own."""
    if cfg.checkpoint_mode == "auto":
        log.info("checkpoint_mode auto outside a launcher's GPU layout: selective recomputation")
        return "selective"
    if cfg.checkpoint_mode == "selective" and cfg.selective_blocks:
        return f"selective:{cfg.selective_blocks}"
    return cfg.checkpoint_mode


def apply_parallelism(
    model: nn.Module, cfg: ParallelConfig, device: torch.device, chunk_size: int = 1024
) -> PackedPolicy:
    """Activation checkpointing, then FSDP2 per block, vision tower and root; returns the root.

    `model` is the Hugging Face model; the returned `PackedPolicy` wraps it (`.model`), so its
    parameters keep their Hugging Face names behind `HF_PREFIX`.
    """
    text = text_checkpoint_mode(cfg)
    if cfg.activation_checkpointing and text == cfg.vision_checkpoint_mode == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.activation_checkpointing:
        from policy.recompute import apply_recompute

        apply_recompute(model, text=text, vision=cfg.vision_checkpoint_mode)
    model.config.use_cache = False
    if cfg.compile:
        from policy.compile import apply_compile

        apply_compile(model, cfg.compile)
    root = PackedPolicy(model, chunk_size=chunk_size, compile_logprobs=cfg.compile == "elementwise")
    low_precision = next(model.parameters()).dtype != torch.float32
    if not distributed() or (low_precision and dist.get_world_size() == 1):
        # bf16 parameters on one rank: FSDP2 would only add a second copy of the parameters and gradients
        return root
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if low_precision:
        mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    elif device.type == "cuda" and cfg.mixed_precision:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    else:
        mp = MixedPrecisionPolicy()
    # one rank: the gathered (bf16) parameters are this rank's own, so freeing them after the forward only
    # buys a second gather-and-cast per block in the backward pass
    reshard = cfg.reshard_after_forward and dist.get_world_size() > 1
    shard_blocks(model, root, mp_policy=mp, reshard_after_forward=reshard)
    return root


def shard_blocks(model: nn.Module, root: nn.Module, **kwargs) -> nn.ModuleList:
    """`fully_shard(..., **kwargs)` per vision block, the vision tower, per decoder block, then `root`
    (embeddings, final norm, lm_head: what no block holds); returns the decoder blocks."""
    from torch.distributed.fsdp import fully_shard

    visual, layers = vision_tower(model), decoder_layers(model)
    if visual is not None:
        for block in visual.blocks:
            fully_shard(block, **kwargs)
        fully_shard(visual, **kwargs)
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(root, **kwargs)
    return layers


def vision_tower(model: nn.Module) -> nn.Module | None:
    """The vision transformer of a Qwen2.5-VL model (None for a text-only model)."""
    inner = getattr(model, "model", model)
    return getattr(inner, "visual", None)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The language model's decoder blocks."""
    inner = getattr(model, "model", model)
    lm = getattr(inner, "language_model", inner)
    return lm.layers


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


def broadcast_bytes(data: bytes | None, src: int = 0) -> bytes | None:
    """Rank `src`'s bytes on every rank (None travels as None); a no-op without a group."""
    if not distributed():
        return data
    device = _collective_device()
    size = torch.tensor([-1 if data is None else len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    n = int(size.item())
    if n < 0:
        return None
    if n == 0:
        return b""
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    if dist.get_rank() == src:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, src=src)
    return buf.cpu().numpy().tobytes()


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_master_weights(mode: str, world_size: int, device: torch.device) -> str:
    """`optim.master_weights` with "auto" resolved: host on one GPU, params otherwise (sharded fp32)."""
    if mode == "auto":
        return "host" if world_size == 1 and device.type == "cuda" else "params"
    if mode != "params" and world_size > 1:
        raise ValueError(
            f"optim.master_weights = {mode!r} runs on one rank; a sharded learner ({world_size} ranks) keeps "
            "its fp32 master weights as FSDP2-sharded parameters: master_weights = params (or auto)"
        )
    return mode


def param_dtype(master_weights: str) -> torch.dtype:
    """The dtype the model's parameters are loaded in: fp32 when they are the master weights, else bf16."""
    return torch.float32 if master_weights == "params" else torch.bfloat16


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, master_weights: str = "params"
) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """AdamW over the trainable parameters, with linear warm-up then a constant rate.

    master_weights = "params": torch's AdamW on the (fp32) parameters; on CUDA the fused kernel (no
    whole-model fp32 temporaries: the foreach path's sqrt(exp_avg_sq) alone is 12 GB for 3B, what ran the
    one-GPU smoke run out of memory), foreach on CPU. "device" / "host": learner.optim.MasterAdamW (bf16
    parameters, fp32 master weights and moments on the GPU or in host memory)."""
    params = [p for p in model.parameters() if p.requires_grad]
    on_cuda = bool(params) and params[0].device.type == "cuda"
    hyper = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if master_weights == "params":
        optimizer = torch.optim.AdamW(params, **hyper, fused=on_cuda, foreach=not on_cuda)
    else:
        from learner.optim import MasterAdamW

        optimizer = MasterAdamW(params, **hyper, location=master_weights, host_threads=cfg.host_threads)
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
