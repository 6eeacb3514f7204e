"""torch.compile per transformer block of a Qwen2.5-VL model (fuses the elementwise ops between matmuls).

    compile_blocks(model, text=True, vision=False)

Each decoder (and optionally vision) block is compiled on its own, after activation checkpointing
is set (policy/checkpointing.py), as torchtitan does: the norms, rotary embedding, SiLU x up and
residual adds of a block become a few fused Triton kernels instead of dozens of eager ones, and
the matmuls and the varlen attention kernel stay what they were. Shapes are marked dynamic, so a
new pack length does not recompile. Compiled blocks give the same values as eager ones (tested on
CPU to 1e-6); the speed matters only on the GPU (bench/gpu_learner.py, variant suffix "+compile").
"""

from __future__ import annotations

from torch import nn


def compile_blocks(model: nn.Module, text: bool = True, vision: bool = False, dynamic: bool = True) -> int:
    """Compile the decoder blocks (and the vision blocks with `vision`) in place; returns how many."""
    inner = getattr(model, "model", model)
    blocks = list(inner.language_model.layers) if text else []
    if vision and getattr(inner, "visual", None) is not None:
        blocks += list(inner.visual.blocks)
    for block in blocks:
        block.compile(dynamic=dynamic)
    return len(blocks)
