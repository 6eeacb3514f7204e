"""torch.compile for the learner's model: fused elementwise ops (norms, SiLU x up, logprobs) or whole blocks.

    compile_elementwise(model)   # RMSNorms and SiLU(gate) * up fused; matmuls and attention stay eager
    compile_blocks(model)        # every decoder block compiled whole

Between its matmuls a decoder block runs dozens of small eager kernels: fp32 RMSNorm (cast, square,
mean, rsqrt, two multiplies, cast back), SiLU(gate) * up, residual adds; under activation
checkpointing they run again in the backward pass. `compile_elementwise` turns the norms and the
SiLU product into fused Triton kernels and leaves every matmul and the varlen attention kernel
eager, so selective activation checkpointing (policy/recompute.py) still sees, and keeps,
their outputs. `compile_blocks` compiles whole blocks as torchtitan does; a compiled block inside a
selectively checkpointed one loses the selective policy (its matmuls are recomputed: full-AC memory
and FLOPs), so use it with full checkpointing (docs/memory.md).
`policy.forward.chunked_logprobs(..., compiled=True)` fuses the fp32 log-softmax / gather / entropy
of each logprob chunk likewise. Shapes are dynamic: a new pack length does not recompile.
Compiled and eager give the same values (tested on CPU to 1e-5).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("", "elementwise", "blocks")


def apply_compile(model: nn.Module, mode: str) -> int:
    """ "" (nothing) | "elementwise" | "blocks"; returns the number of modules compiled or patched."""
    if mode not in MODES:
        raise ValueError(f"compile mode {mode!r}: choose from {MODES}")
    if mode == "elementwise":
        return compile_elementwise(model)
    if mode == "blocks":
        return compile_blocks(model)
    return 0


def compile_blocks(model: nn.Module, text: bool = True, vision: bool = False, dynamic: bool = True) -> int:
    """Compile the decoder blocks (and the vision blocks with `vision`) in place; returns how many."""
    inner = getattr(model, "model", model)
    blocks = list(inner.language_model.layers) if text else []
    if vision and getattr(inner, "visual", None) is not None:
        blocks += list(inner.visual.blocks)
    for block in blocks:
        block.compile(dynamic=dynamic)
    return len(blocks)


def compile_elementwise(model: nn.Module, dynamic: bool = True) -> int:
    """Compile every RMSNorm, fuse SiLU(gate) * up in every SiLU MLP (text and vision); returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.compile(dynamic=dynamic)
            count += 1
        elif _is_silu_mlp(module):
            module.forward = types.MethodType(_fused_mlp_forward, module)
            count += 1
    return count


def _is_silu_mlp(module: nn.Module) -> bool:
    if not all(hasattr(module, name) for name in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return False
    return isinstance(module.act_fn, nn.SiLU) or type(module.act_fn).__name__ == "SiLUActivation"


def _fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul()(self.gate_proj(x), self.up_proj(x)))


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@functools.lru_cache(maxsize=1)
def silu_mul():
    """SiLU(gate) * up as one compiled kernel (forward and backward)."""
    return torch.compile(_silu_mul, dynamic=True)
