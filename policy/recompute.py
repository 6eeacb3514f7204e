"""Activation recomputation ("activation checkpointing") for a Qwen2.5-VL model, per block.

Not model checkpoints (those are learner/checkpoint.py). Modes: full, selective (op-level), none.

transformers' `gradient_checkpointing_enable` recomputes every block whole ("full"): the
forward's matrix products run twice, about a third more model FLOPs per step. "selective"
checkpointing (torchtitan's op-level SAC) keeps the outputs of the matrix products and of the
attention kernel and recomputes only the cheap elementwise ops (norms, rotary, SiLU, residuals)
in the backward pass; it costs memory (about 15x full checkpointing's saved activations per token
for a 7B decoder block) and saves nearly all recompute FLOPs.

    apply_recompute(model, text="selective", vision="full")

`text` / `vision` choose the mode of the decoder blocks / vision blocks: "full", "selective",
"none", or "selective:<k>" (selective on the first k decoder blocks, full on the rest: the knob
that fits a memory budget).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

MODES = ("full", "selective", "none")


def saved_ops() -> set:
    """Ops whose outputs selective checkpointing keeps: matrix products and attention kernels."""
    aten = torch.ops.aten
    ops = {
        aten.mm.default,
        aten.addmm.default,
        aten.bmm.default,
        aten.baddbmm.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._flash_attention_forward.default,
        aten._efficient_attention_forward.default,
    }
    for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            ops.add(getattr(aten, name).default)
    attn = getattr(torch.ops, "torch_attn", None)
    if attn is not None:
        for name in ("_varlen_attn", "_varlen_attn_out"):
            try:
                ops.add(getattr(attn, name).default)
            except (AttributeError, RuntimeError):
                pass
    flash = getattr(torch.ops, "flash_attn", None)  # flash-attn's custom ops, when installed
    if flash is not None:
        for name in ("_flash_attn_varlen_forward", "_flash_attn_forward"):
            try:
                ops.add(getattr(flash, name).default)
            except (AttributeError, RuntimeError):
                pass
    return ops


@functools.lru_cache(maxsize=1)
def _saved() -> frozenset:
    return frozenset(saved_ops())


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _saved() else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """A `context_fn` for torch.utils.checkpoint that keeps matmul/attention outputs."""
    return create_selective_checkpoint_contexts(_policy)


def parse_mode(mode: str, blocks: int) -> list[str]:
    """Per-block modes from "full" | "selective" | "none" | "selective:<k>"."""
    if mode.startswith("selective:"):
        k = int(mode.split(":", 1)[1])
        if not 0 <= k <= blocks:
            raise ValueError(f"selective:{k} needs 0 <= k <= {blocks}")
        return ["selective"] * k + ["full"] * (blocks - k)
    if mode not in MODES:
        raise ValueError(f"checkpointing mode {mode!r}: choose from {MODES} or selective:<k>")
    return [mode] * blocks


def _set(block: nn.Module, mode: str) -> None:
    block.gradient_checkpointing = mode != "none"
    if mode == "selective":
        block._gradient_checkpointing_func = functools.partial(
            checkpoint, use_reentrant=False, context_fn=selective_context
        )
    else:
        block._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)


def apply_recompute(model: nn.Module, text: str = "full", vision: str = "full") -> dict[str, list[str]]:
    """Set the recompute mode of every decoder and vision block of a Qwen2.5-VL `model`; returns the plan."""
    inner = getattr(model, "model", model)
    layers = inner.language_model.layers
    blocks = inner.visual.blocks if getattr(inner, "visual", None) is not None else []
    plan = {"text": parse_mode(text, len(layers)), "vision": parse_mode(vision, len(blocks))}
    model.config.use_cache = False
    for block, mode in zip(layers, plan["text"]):
        _set(block, mode)
    for block, mode in zip(blocks, plan["vision"]):
        _set(block, mode)
    return plan
