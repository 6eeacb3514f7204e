"""The GPU memory estimate of a layout: what the learner's states need, what one GPU leaves them, and
what a training pack's activations take per token.

Memory is estimated, never measured here (the launcher never initialises CUDA): `learner_memory_gib` for
the states, `activation_bytes_per_token` for a training pack, both calibrated on an H200
(docs/benchmarks.md). `learner_need_gib` and `learner_room_gib` put the states on one GPU of a layout,
beside vLLM's share where the GPU is shared; `check_learner_fits` and `check_engine_fits` refuse a
layout whose learner or vLLM engine does not fit, naming the fix (`memory_fix`). Used by
deploy/gpus/layout.py; tested in tests/unit/deploy/test_gpu_plan.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from deploy.gpus.indices import LayoutError

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


def learner_need_gib(
    n_params: int,
    ranks: int,
    shared: bool,
    *,
    kl: bool,
    master_weights: str,
    reference: str,
    params_in_buffer: bool,
) -> float:
    """The learner's states per GPU on a layout (`learner_memory_gib`; 0 without a parameter count). A
    `shared` GPU holds the CUDA-IPC weight buffer the generator maps too (weights/ipc_sender.py), unless the
    learner's bf16 parameters live in it (`params_in_buffer` with the master weights in host memory)."""
    need = learner_memory_gib(n_params, ranks, kl, master_weights, reference) if n_params else 0.0
    if shared and not (params_in_buffer and bf16_parameters(master_weights, ranks)):
        need += 2 * n_params / 2**30
    return need


def learner_room_gib(gpu_gib: float, engine_gib: float, shared: bool) -> float:
    """What one GPU of `gpu_gib` leaves the learner: all of it on a split layout; on a shared one, what
    vLLM's share (`engine_gib`) and the engine's ENGINE_OVERHEAD_GIB beyond it leave."""
    return gpu_gib - engine_gib - ENGINE_OVERHEAD_GIB if shared else gpu_gib


def memory_fix(shared: bool, kl: bool) -> str:
    """What to change when the learner does not fit on a layout (the end of its LayoutError)."""
    if not shared:
        return "give the learner more GPUs (--learner.gpus) or use a smaller model"
    return (
        "lower --generator.engine.gpu-memory-utilization, keep the master weights in host memory "
        "(--learner.optim.master-weights host)"
        + (", the KL reference model too (--learner.parallel.reference-location host)" if kl else "")
        + ", use a split layout (--learner.gpus 0-5 --generator.gpus 6-7) or a smaller model"
    )


def check_learner_fits(need: float, room: float, gpu_gib: float, n_params: int, ranks: int, fix: str) -> None:
    """A LayoutError when the learner's states (`need`) exceed the `room` its GPUs leave it."""
    if need > room:
        raise LayoutError(
            f"the learner needs at least {need:.1f} GiB per GPU for {n_params / 1e9:.2f} B parameters "
            f"({ranks} GPU(s); before activations), but only {room:.1f} GiB of {gpu_gib:.0f} GiB is left "
            f"for it: {fix}"
        )


def check_engine_fits(n_params: int, tp: int, engine_gib: float, gpu_memory_utilization: float) -> None:
    """A LayoutError when vLLM's share of a GPU cannot hold one engine's shard of the bf16 weights."""
    weights = 2 * n_params / tp / 2**30
    if weights + CONTEXT_GIB > engine_gib:
        raise LayoutError(
            f"vLLM may take {engine_gib:.1f} GiB per GPU (gpu_memory_utilization {gpu_memory_utilization}) "
            f"but the model's bf16 weights alone are {weights:.1f} GiB per engine: raise "
            f"--generator.engine.gpu-memory-utilization or --generator.tp"
        )


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
