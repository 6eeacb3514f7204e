"""Pack fitting: the largest training pack whose activations fit beside the learner's states on a GPU.

On either GPU layout the learner's training packs (batching.max_tokens_per_microbatch) are capped at the
largest power of two that fits in what the states leave (`largest_pack`), keeping NO_GRAD_MARGIN_GIB for
the no-grad passes; `fit_pack` returns the config's size or that cap, and refuses a GPU that cannot hold
even a 1024-token pack. deploy/gpus/layout.py's `plan_recompute` compares the caps of two recompute
settings with it. Tested in tests/unit/deploy/test_gpu_plan.py.
"""

from __future__ import annotations

from deploy.gpus.indices import LayoutError

NO_GRAD_MARGIN_GIB = 4.0
"""Room kept beside the training packs for the no-grad passes' bigger packs (one block's activations at a
time) and the allocator's fragmentation."""


def largest_pack(free_gib: float, token_bytes: float) -> int:
    """The largest power-of-two pack (the sizes measured) whose activations fit in `free_gib` beside the
    learner's states, keeping NO_GRAD_MARGIN_GIB; 0 when not even 1024 tokens fit."""
    tokens = int(max(free_gib - NO_GRAD_MARGIN_GIB, 0.0) * 2**30 / token_bytes)
    return 0 if tokens < 1024 else 1 << (tokens.bit_length() - 1)


def fit_pack(pack_tokens: int, token_bytes: float, free_gib: float, fix: str) -> int:
    """The training pack size a GPU with `free_gib` beside the learner's states runs: the config's
    `pack_tokens`, or the largest that fits when that one does not. Without a pack size or an activation
    estimate (`token_bytes` 0) the config's is kept; a GPU too small for a 1024-token pack is a LayoutError
    ending in `fix`."""
    if not (pack_tokens and token_bytes):
        return pack_tokens
    fits = largest_pack(free_gib, token_bytes)
    if not fits:
        raise LayoutError(
            f"the learner's states leave {free_gib:.1f} GiB per GPU, too little for the activations of a "
            f"1024-token training pack ({1024 * token_bytes / 2**30:.1f} GiB) and the no-grad passes "
            f"({NO_GRAD_MARGIN_GIB:.0f} GiB): {fix}"
        )
    return min(pack_tokens, fits)
