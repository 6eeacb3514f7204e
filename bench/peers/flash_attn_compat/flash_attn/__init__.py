"""FlashAttention-2's Python API (`flash_attn_func`, `flash_attn_varlen_func`) over PyTorch's flash attention.

verl's sequence packing for Qwen2.5-VL (`use_remove_padding`) and transformers' "flash_attention_2" call the
flash-attn package, which PyPI ships only as source (a CUDA build of an hour or more). PyTorch has the same
FlashAttention-2 kernels built in: `torch.nn.attention.varlen.varlen_attn` for packed sequences (with its
backward), `scaled_dot_product_attention` for padded batches. bench/peers/verl_grpo.py puts this package on
verl's path, as version 2.8.3 (verl's pin), so verl runs its documented recipe on the same attention kernels
Parallax's learner uses (policy/forward.py). Off CUDA, or in float32, packed attention runs SDPA one sequence
at a time (tests check the two agree). Unsupported options (dropout, alibi, softcap, a KV cache) raise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__version__ = "2.8.3"


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, deterministic=False, return_attn_probs=False, **kwargs,
):  # fmt: skip
    """Padded batch attention: q (batch, seqlen_q, heads, dim), k/v (batch, seqlen_k, kv_heads, dim)."""
    _check_options(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qt, kt, vt, is_causal=causal, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2]
    )
    return out.transpose(1, 2)


def flash_attn_varlen_func(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
    causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
    return_attn_probs=False, block_table=None, **kwargs,
):  # fmt: skip
    """Packed attention: q (total_q, heads, dim), k/v (total_k, kv_heads, dim); sequence i is rows
    cu_seqlens[i]:cu_seqlens[i+1]. Causal masks align at the end, as flash-attn's do."""
    _check_options(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs)
    if block_table is not None:
        raise NotImplementedError("flash_attn_compat: no paged KV cache")
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_seqlens_k.to(torch.int32)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        return _torch_varlen(q, k, v, cu_q, cu_k, int(max_seqlen_q), int(max_seqlen_k), softmax_scale, causal)
    return _sdpa_per_sequence(q, k, v, cu_q, cu_k, softmax_scale, causal)


def flash_attn_with_kvcache(*args, **kwargs):
    """Decoding with a KV cache: not needed for training, not provided."""
    raise NotImplementedError("flash_attn_compat provides no KV-cache decoding")


def _check_options(dropout_p, window_size, softcap, alibi_slopes, return_attn_probs) -> None:
    if dropout_p:
        raise NotImplementedError("flash_attn_compat: attention dropout is not supported")
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError(f"flash_attn_compat: no sliding window (window_size={window_size})")
    if softcap or alibi_slopes is not None or return_attn_probs:
        raise NotImplementedError("flash_attn_compat: no softcap, alibi or attention probabilities")


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    """torch.nn.attention.varlen.varlen_attn; grouped KV heads repeated where it takes no enable_gqa."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kwargs = {"scale": scale}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kwargs["is_causal"] = causal
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def _sdpa_per_sequence(q, k, v, cu_q, cu_k, scale, causal):
    """The reference path: SDPA over each sequence in turn -> (total_q, heads, dim)."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for i in range(cu_q.numel() - 1):
        qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        qi, ki, vi = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        if groups > 1:
            ki, vi = ki.repeat_interleave(groups, dim=0), vi.repeat_interleave(groups, dim=0)
        mask = None
        if causal:  # query j sees keys up to j + (keys - queries): aligned at the end
            mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device).tril(ke - ks - (qe - qs))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(outs, dim=0)
