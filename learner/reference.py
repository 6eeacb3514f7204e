"""The frozen reference model of the KL term: built beside the policy, on the GPU or in host memory.

    ref = build_reference(learner)      # learner.trainer builds it when loss.kl_coef > 0

`parallel.reference_location` says where its bf16 weights live:
  device  on the GPU, sharded and compiled like the policy (2 bytes a parameter over the ranks);
  host    in page-locked host memory: FSDP2's own CPU offload (`CPUOffloadPolicy`) copies each block's weights
          to the GPU for its forward and frees them after it, the next decoder block's copy issued while
          the current one computes (`set_modules_to_forward_prefetch`). The GPU holds one or two blocks and
          the root's embeddings and lm_head instead of the whole model: what lets a 7B learner share an 80 GB
          card with its vLLM (deploy/layout.py chooses it for "auto"). Each no-grad pack copies the model
          to the GPU once (16.6 GB at 7B, about 0.4 s over PCIe 5 page-locked), hidden behind the pack's
          compute where the packs are large (`batching.no_grad_tokens_per_microbatch`). Not compiled: the
          reference pass keeps its eager kernels rather than mixing torch.compile with the offload hooks.
  auto    the launcher's GPU layout resolves it (host only where the device does not fit); a learner started
          on its own keeps the model on the device.
On a CPU run every location is host memory, and "host" builds the same plain model as "device".

The shards are page-locked where they lie (`page_lock`: cudaHostRegister) rather than copied by FSDP2 into
torch's pinned allocator, which rounds each block up to a power of two (a 7B MLP weight of 136 MB would take
256 MB, the whole model about twice its size); the torch that stops that (`pinned_max_round_threshold_mb`)
is newer than the GPU image's 2.11. Where registering fails the weights stay pageable (slower copies).
"""

from __future__ import annotations

import logging
import os

import torch

from runtime.hostmem import check_host_memory

log = logging.getLogger(__name__)


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
    """`model` (frozen, on CPU) under FSDP2 with its weights in page-locked host memory, streamed to `device`
    block by block in its forward; returns the `PackedPolicy` root. Needs a process group (the learner has
    one on every GPU, a one-rank group on a single GPU)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy

    from learner.parallel import shard_blocks
    from policy.forward import PackedPolicy

    if not dist.is_initialized():
        raise RuntimeError("a reference model in host memory needs a process group (learner.parallel)")
    model.eval()
    model.config.use_cache = False
    root = PackedPolicy(model, chunk_size=chunk_size, device=device)
    layers = shard_blocks(
        model, root, offload_policy=CPUOffloadPolicy(pin_memory=False), reshard_after_forward=True
    )
    for layer, following in zip(layers, list(layers)[1:]):
        layer.set_modules_to_forward_prefetch([following])
    pinned = False
    if device.type == "cuda":
        pinned = page_lock(root)
        torch.cuda.empty_cache()  # each block passed through the GPU on its way to host memory
    log.info(
        "KL reference model in %s host memory: %.2f GB, streamed to %s block by block",
        "page-locked" if pinned else "pageable",
        sum(p.numel() * p.element_size() for p in root.parameters()) / 1e9,
        device,
    )
    return root


def page_lock(module: torch.nn.Module) -> bool:
    """Page-lock the host storage of `module`'s parameters where it lies (cudaHostRegister), so that FSDP2's
    non-blocking copies to the GPU run at DMA speed without a second, rounded-up pinned copy; the memory stays
    registered for the process's life (the reference's). False (logged) where CUDA refuses."""
    storages = {}
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        storage = local.untyped_storage()
        if storage.device.type == "cpu" and storage.nbytes():
            storages[storage.data_ptr()] = storage.nbytes()
    cudart = torch.cuda.cudart()
    for start, size in page_spans(storages.items(), os.sysconf("SC_PAGE_SIZE")):
        err = cudart.cudaHostRegister(start, size, 0)
        if int(err) != 0:
            log.warning(
                "cudaHostRegister failed (%s): the reference's weights stay pageable",
                cudart.cudaGetErrorString(err),
            )
            return False
    return True


def page_spans(blocks, page: int) -> list[tuple[int, int]]:
    """(start, size) of the whole pages under the (address, size) `blocks`, pages shared by two blocks merged
    into one span: CUDA registers each page once, and small heap blocks can share a page."""
    spans = sorted((addr // page * page, -(-(addr + size) // page) * page) for addr, size in blocks)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in merged]
