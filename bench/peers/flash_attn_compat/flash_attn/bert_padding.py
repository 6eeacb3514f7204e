"""flash-attn's padding helpers (`flash_attn.bert_padding`) in plain torch: moving rows between a padded
(batch, seqlen, ...) layout and the packed (tokens, ...) layout of the non-pad tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange, repeat  # noqa: F401 - flash-attn's module exports both

__all__ = ["index_first_axis", "pad_input", "rearrange", "repeat", "unpad_input"]


def index_first_axis(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Rows `indices` of `x` (first axis); gradients flow back to those rows."""
    return x.index_select(0, indices)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """(batch, seqlen, ...) + mask -> (the non-pad rows packed, their flat indices, cu_seqlens, the longest
    sequence, each sequence's length)."""
    mask = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = mask.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, int(seqlens.max()), used


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """Packed rows back into a zero-padded (batch, seqlen, ...) tensor."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_copy(0, indices, hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
