"""The frozen reference model of the KL term: built beside the policy, on the GPU or in host memory.

    ref = build_reference(learner)      # learner.trainer builds it when loss.kl_coef > 0

`parallel.reference_location` says where its bf16 weights live:
  device  on the GPU, sharded and compiled like the policy (2 bytes a parameter over the ranks);
  host    in pinned host memory: FSDP2's own CPU offload (`CPUOffloadPolicy`) copies each block's weights
          to the GPU for its forward and frees them after it, the next decoder block's copy issued while
          the current one computes (`set_modules_to_forward_prefetch`). The GPU holds one or two blocks and
          the root's embeddings and lm_head instead of the whole model: what lets a 7B learner share an 80 GB
          card with its vLLM (deploy/layout.py chooses it for "auto"). Each no-grad pack copies the model
          to the GPU once (16.6 GB at 7B, about 0.3 s over PCIe 5 at pinned speed), hidden behind the pack's
          compute where the packs are large (`batching.no_grad_tokens_per_microbatch`). Not compiled: the
          reference pass keeps its eager kernels rather than mixing torch.compile with the offload hooks.
  auto    the launcher's GPU layout resolves it (host only where the device does not fit); a learner started
          on its own keeps the model on the device.
On a CPU run every location is host memory, and "host" builds the same plain model as "device".

torch's pinned allocator rounds each block up to a power of two (a 7B MLP weight of 136 MB would take
256 MB, the whole model about twice its size); `limit_pinned_rounding` stops that above 64 MB (torch's
`pinned_max_round_threshold_mb`), and where a torch has no such setting the weights stay in pageable memory.
"""

from __future__ import annotations

import logging

import torch

from runtime.hostmem import check_host_memory

log = logging.getLogger(__name__)

PINNED_ROUND_MB = 64
"""Pinned host blocks above this many MB are allocated at their size, not rounded up to a power of two."""


def reference_location(location: str, device: torch.device) -> str:
    """Where the reference model is built: "auto" (no launcher layout) and any location on CPU -> "device"."""
    if device.type != "cuda":
        return "device"
    return "host" if location == "host" else "device"


def build_reference(learner):
    """The frozen bf16 reference model (see the module docstring), as a `policy.forward.PackedPolicy`."""
    from learner.config import ParallelConfig
    from learner.parallel import apply_parallelism
    from policy.loading import load_model

    cfg = learner.cfg
    device = learner.info.device
    bf16 = device.type == "cuda" and cfg.parallel.mixed_precision
    dtype = torch.bfloat16 if bf16 else learner.param_dtype
    host = reference_location(cfg.parallel.reference_location, device) == "host"
    ref = load_model(cfg.model, dtype=dtype, device="cpu" if host else device)
    ref.eval().requires_grad_(False)
    if host:
        n_bytes = sum(p.numel() * p.element_size() for p in ref.parameters()) // learner.info.world_size
        check_host_memory(
            n_bytes,
            "the KL reference model in host memory (parallel.reference_location=host)",
            "keep it on the GPU (--learner.parallel.reference-location device) or use more learner GPUs",
        )
        return offload_to_host(ref, device)
    pcfg = ParallelConfig(
        activation_checkpointing=False,
        mixed_precision=cfg.parallel.mixed_precision,
        compile=cfg.parallel.compile,
    )
    return apply_parallelism(ref, pcfg, device)


def offload_to_host(model, device: torch.device, chunk_size: int = 1024):
    """`model` (frozen, on CPU) under FSDP2 with its weights in pinned host memory, streamed to `device` block
    by block in its forward; returns the `PackedPolicy` root. Needs a process group (the learner has one on
    every GPU, a one-rank group on a single GPU)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy

    from learner.parallel import shard_blocks
    from policy.forward import PackedPolicy

    if not dist.is_initialized():
        raise RuntimeError("a reference model in host memory needs a process group (learner.parallel)")
    # pinned where its blocks can be allocated at their size; else pageable (slower copies, no doubling)
    pin = device.type == "cuda" and limit_pinned_rounding()
    model.eval()
    model.config.use_cache = False
    root = PackedPolicy(model, chunk_size=chunk_size)
    layers = shard_blocks(
        model, root, offload_policy=CPUOffloadPolicy(pin_memory=pin), reshard_after_forward=True
    )
    for layer, following in zip(layers, list(layers)[1:]):
        layer.set_modules_to_forward_prefetch([following])
    if pin:
        torch.cuda.empty_cache()  # each block passed through the GPU on its way to pinned memory
    log.info(
        "KL reference model in %s host memory: %.2f GB, streamed to %s block by block",
        "pinned" if pin else "pageable",
        sum(p.numel() * p.element_size() for p in root.parameters()) / 1e9,
        device,
    )
    return root


def limit_pinned_rounding(mb: int = PINNED_ROUND_MB) -> bool:
    """Stop torch's pinned allocator from rounding blocks above `mb` MB up to a power of two (module
    docstring); False (logged) where this torch has no such setting."""
    setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        if setting is None:
            raise RuntimeError("no torch._C._accelerator_setAllocatorSettings")
        setting(f"pinned_max_round_threshold_mb:{mb}")
    except RuntimeError as e:
        log.warning("this torch cannot limit pinned-memory rounding (%s): the reference stays pageable", e)
        return False
    return True
