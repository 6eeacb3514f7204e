"""The frozen reference model of the KL term: built beside the policy, on the GPU or in host memory.

    ref = build_reference(cfg, info, param_dtype)   # learner.trainer builds it when loss.kl_coef > 0

`parallel.reference_location` says where its bf16 weights live:
  device  on the GPU, sharded and compiled like the policy (2 bytes a parameter over the ranks);
  host    in page-locked host memory: FSDP2's own CPU offload (`CPUOffloadPolicy`) copies each block's weights
          to the GPU for its forward and frees them after it, the next decoder block's copy issued while
          the current one computes (`set_modules_to_forward_prefetch`). The GPU holds one or two blocks and
          the root's embeddings and lm_head instead of the whole model: what lets a 7B learner share an 80 GB
          card with its vLLM (deploy/gpus/layout.py chooses it for "auto"). Each no-grad pack copies the model
          to the GPU once (16.6 GB at 7B, about 0.4 s over PCIe 5 page-locked), hidden behind the pack's
          compute where the packs are large (`batching.no_grad_tokens_per_microbatch`). With
          `parallel.compile = "elementwise"` its norms, SiLU products and logprob chunks run the same fused
          kernels as on the device (pure functions inside a block, beneath FSDP2's hooks); "blocks" would
          compile the modules FSDP2 hooks, so under it the host reference stays eager.
  auto    the launcher's GPU layout resolves it (host only where the device does not fit); a learner started
          on its own keeps the model on the device.
On a CPU run every location is host memory, and "host" builds the same plain model as "device".

The shards are moved into one anonymous memory map of their own (`into_host_slab`) and that map is page-locked
(`page_lock`: cudaHostRegister), rather than copied by FSDP2 into torch's pinned allocator, which rounds each
block up to a power of two (a 7B MLP weight of 136 MB would take 256 MB, the whole model about twice its size;
the torch that stops that, `pinned_max_round_threshold_mb`, is newer than the GPU stack's 2.11). The map is
the reference's alone: registering heap pages in place would also lock the neighbours that share them, and a
later copy into such a neighbour fails (cudaErrorInvalidValue; docs/benchmarks.md, 2026-12-06). Where
registering fails the weights stay pageable (slower copies).
"""

from __future__ import annotations

import logging
import mmap
import weakref

import torch

from runtime.hostmem import check_host_memory

log = logging.getLogger(__name__)


def reference_location(location: str, device: torch.device) -> str:
    """Where the reference model is built: "auto" (no launcher layout) and any location on CPU -> "device"."""
    if device.type != "cuda":
        return "device"
    return "host" if location == "host" else "device"


def build_reference(cfg, info, param_dtype: torch.dtype):
    """The frozen bf16 reference model (see the module docstring) of the learner config `cfg`, on this rank
    (`info`, learner.parallel.DistInfo), as a `policy.forward.PackedPolicy`; it has the policy's parameter
    dtype `param_dtype` unless bf16 mixed precision runs on a GPU."""
    from learner.config import ParallelConfig
    from learner.parallel import apply_parallelism
    from policy.loading import load_model

    device = info.device
    bf16 = device.type == "cuda" and cfg.parallel.mixed_precision
    dtype = torch.bfloat16 if bf16 else param_dtype
    host = reference_location(cfg.parallel.reference_location, device) == "host"
    ref = load_model(cfg.model, dtype=dtype, device="cpu" if host else device)
    ref.eval().requires_grad_(False)
    if host:
        n_bytes = sum(p.numel() * p.element_size() for p in ref.parameters()) // info.world_size
        check_host_memory(
            n_bytes,
            "the KL reference model in host memory (parallel.reference_location=host)",
            "keep it on the GPU (--learner.parallel.reference-location device) or use more learner GPUs",
        )
        mode = "elementwise" if cfg.parallel.compile == "elementwise" else ""
        return offload_to_host(ref, device, compile_mode=mode)
    pcfg = ParallelConfig(
        activation_checkpointing=False,
        mixed_precision=cfg.parallel.mixed_precision,
        compile=cfg.parallel.compile,
    )
    return apply_parallelism(ref, pcfg, device)


def offload_to_host(model, device: torch.device, chunk_size: int = 1024, compile_mode: str = ""):
    """`model` (frozen, on CPU) under FSDP2 with its weights in page-locked host memory, streamed to `device`
    block by block in its forward; returns the `PackedPolicy` root. Needs a process group (the learner has
    one on every GPU, a one-rank group on a single GPU). `compile_mode`: "" (eager) or "elementwise"
    (policy/compile.py)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy

    from learner.parallel import shard_blocks
    from policy.forward import PackedPolicy

    if compile_mode not in ("", "elementwise"):
        raise ValueError(
            f"a reference in host memory compiles elementwise or not at all, not {compile_mode!r}"
        )
    if not dist.is_initialized():
        raise RuntimeError("a reference model in host memory needs a process group (learner.parallel)")
    model.eval()
    model.config.use_cache = False
    if compile_mode:
        from policy.compile import apply_compile

        apply_compile(model, compile_mode)
    root = PackedPolicy(model, chunk_size=chunk_size, device=device, compile_logprobs=bool(compile_mode))
    layers = shard_blocks(
        model, root, offload_policy=CPUOffloadPolicy(pin_memory=False), reshard_after_forward=True
    )
    for layer, following in zip(layers, list(layers)[1:]):
        layer.set_modules_to_forward_prefetch([following])
    slab = into_host_slab(root)
    pinned = False
    if device.type == "cuda":
        pinned = page_lock(root, slab, device)
        torch.cuda.empty_cache()  # each block passed through the GPU on its way to host memory
    log.info(
        "KL reference model in %s host memory: %.2f GB, streamed to %s block by block",
        "page-locked" if pinned else "pageable",
        slab.numel() / 1e9,
        device,
    )
    return root


SLAB_ALIGN = 512  # bytes between two shards in the slab: a multiple of every dtype's size and of cache lines


@torch.no_grad()
def into_host_slab(module: torch.nn.Module) -> torch.Tensor:
    """Move the host shards of `module`'s parameters into one anonymous memory map (returned as a uint8
    tensor) that no other allocation shares. Module by module, each shard's tensor is re-pointed in place
    (`set_`) and the module's load-state-dict hooks run, through which FSDP2 re-reads its shards
    (`reset_sharded_param`, what it does after `load_state_dict`) and drops the old copy. A shard FSDP2 pads
    (uneven sharding over ranks) it copies back out: that one stays outside the slab, pageable."""
    shards = {id(local): local for local in map(host_shard, module.parameters()) if local is not None}
    offsets, total = {}, 0
    for key, local in shards.items():
        offsets[key] = total
        total += -(-local.nbytes // SLAB_ALIGN) * SLAB_ALIGN
    page = mmap.PAGESIZE
    slab = torch.frombuffer(mmap.mmap(-1, max(-(-total // page) * page, page)), dtype=torch.uint8)
    for owner in module.modules():
        moved = [local for local in map(host_shard, owner.parameters(recurse=False)) if id(local) in offsets]
        for local in moved:
            offset = offsets.pop(id(local))
            slab[offset : offset + local.nbytes].view(local.dtype).view(local.shape).copy_(local)
            local.set_(slab.untyped_storage(), offset // local.element_size(), local.shape, local.stride())
        if moved:
            owner.load_state_dict({}, strict=False)  # FSDP2's post-load hooks: its shards re-read
    module.load_state_dict({}, strict=False)  # a shared parameter's hook may sit on its other module
    return slab


def host_shard(param: torch.Tensor) -> torch.Tensor | None:
    """The tensor holding this rank's part of `param` where it is in host memory and not empty, else None: a
    DTensor's own local tensor, the one FSDP2 re-reads (`to_local()` returns an alias of it)."""
    local = getattr(param, "_local_tensor", param)
    return local if local.device.type == "cpu" and local.numel() else None


def page_lock(module: torch.nn.Module, slab: torch.Tensor, device: torch.device) -> bool:
    """Page-lock `slab` (cudaHostRegister) so that FSDP2's copies to the GPU run at DMA speed; it is
    unregistered when `module` is collected, before the slab can be unmapped. False (logged) where CUDA
    refuses."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(slab.data_ptr(), slab.nbytes, 0)
    if int(err) != 0:
        log.warning(
            "cudaHostRegister failed (%s): the reference's weights stay pageable",
            cudart.cudaGetErrorString(err),
        )
        clear_cuda_error(device)
        return False
    weakref.finalize(module, cudart.cudaHostUnregister, slab.data_ptr()).atexit = False
    return True


def clear_cuda_error(device: torch.device) -> None:
    """A failed CUDA runtime call stays CUDA's last error until read, and torch's next kernel launch check
    reads it and raises it as its own; torch binds no cudaGetLastError, so one launch here consumes it."""
    try:
        torch.ones(1, device=device).add_(1)
    except RuntimeError:
        pass
