"""Packed forward of a Qwen2.5-VL or Qwen3-VL model: per-token logprobs (and entropy) of response tokens.

`PackedPolicy(hf_model)` wraps a transformers `Qwen2_5_VLForConditionalGeneration` or
`Qwen3VLForConditionalGeneration` (the family is whatever the checkpoint is); its
forward takes a `policy.packing.PackedBatch` and returns, for every response token of every
sample (in pack order), the log-probability of that token and the entropy of the predictive
distribution, both fp32, at the given temperature. Wrap it (not the bare HF model) as the
FSDP root, so that the embedding and lm_head are gathered by the root's hooks.

Attention sees sequence boundaries through cu_seqlens (transformers' FlashAttentionKwargs):
a registered attention function "parallax_varlen" runs flash-attn's varlen kernel when it is
installed (CUDA, fp16/bf16), else torch's `varlen_attn` on CUDA, else SDPA per sequence (the
CPU path). Without cu_seqlens (generate, padded batches) it is plain SDPA.

Qwen3-VL's DeepStack: the vision tower also returns features of some early blocks, which the
decoder adds at the image tokens after its first layers; the packed forward passes them (and the
image-token mask of the row) to the decoder exactly as transformers' own forward does.

The vocabulary projection runs over response positions only, in chunks of `chunk_size` rows,
each chunk under activation checkpointing when gradients are on: full-vocabulary fp32 logits
of a whole pack never exist at once, in forward or backward.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from policy.packing import PackedBatch

ATTN_NAME = "parallax_varlen"
VISION_ATTN_NAME = "parallax_flash_varlen"
"""The vision tower's name for the same function: "flash" in it makes transformers' vision attention
pass its window/image cu_seqlens in one call instead of looping over windows with SDPA."""
_registered = False


def attention_backend(query: torch.Tensor) -> str:
    """flash_attn | torch_varlen | sdpa_loop, for this query tensor (override: PARALLAX_ATTN_BACKEND)."""
    forced = os.environ.get("PARALLAX_ATTN_BACKEND")
    if forced:
        return forced
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16):
        try:
            import flash_attn  # noqa: F401

            return "flash_attn"
        except ImportError:
            pass
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401

            return "torch_varlen"
        except ImportError:
            pass
    return "sdpa_loop"


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    kv_index: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: attention within each packed sequence (causal unless is_causal=False).

    query (1, H, T, D), key/value (1, Hkv, T, D) -> output (1, T, H, D). With `kv_index` (shared prompts,
    policy/packing.py), query piece i attends to the keys at the rows
    kv_index[cu_seq_lens_k[i]:cu_seq_lens_k[i+1]], causal aligned at the end; the gather's backward adds
    a shared prompt's key gradients up.
    """
    if cu_seq_lens_q is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    if query.shape[0] != 1:
        raise ValueError("packed attention expects batch size 1 (one packed row)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    cu = cu_seq_lens_q.to(device=query.device, dtype=torch.int32)
    max_len = int(max_length_q) if max_length_q is not None else int((cu[1:] - cu[:-1]).max())
    cu_k, max_k = cu, max_len
    if kv_index is not None:  # shared prompts (policy/packing.py): each piece's keys, gathered below
        cu_k, max_k = cu_seq_lens_k.to(device=query.device, dtype=torch.int32), int(max_length_k)
    backend = attention_backend(query)
    if backend == "sdpa_loop":
        if kv_index is not None:
            key, value = key.index_select(2, kv_index), value.index_select(2, kv_index)
        return _sdpa_per_sequence(query, key, value, cu, cu_k, dropout, scaling, causal), None
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, heads, D)
    if kv_index is not None:  # gathered rows come out contiguous, (T_k, heads, D) as the kernels read them
        k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
    if backend == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q, k, v, cu, cu_k, max_len, max_k, dropout_p=dropout, softmax_scale=scaling, causal=causal
        )
    else:
        out = _torch_varlen(q, k, v, cu, cu_k, max_len, max_k, scaling, causal)
    return out.unsqueeze(0), None


def _torch_varlen(q, k, v, cu, cu_k, max_len, max_k, scaling, causal) -> torch.Tensor:
    """torch.nn.attention.varlen.varlen_attn; GQA by repeating heads where the kernel cannot."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    kwargs = {"scale": scaling}
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
    return varlen_attn(q, k, v, cu, cu_k, max_len, max_k, **kwargs)


@functools.cache
def _varlen_params() -> frozenset[str]:
    """The keyword names torch's `varlen_attn` takes (they changed between torch releases), read once: a
    training step calls it once per layer and pack, forward and backward."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _sdpa_per_sequence(query, key, value, cu, cu_k, dropout, scaling, causal) -> torch.Tensor:
    """(1, heads, T, D) query pieces against their keys with SDPA, one piece at a time -> (1, T, heads, D).
    A piece with more keys than queries is causal aligned at the end (flash-attn's convention; SDPA's
    is_causal aligns at the start), so its mask is explicit."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    outs = []
    for (s, e), (sk, ek) in zip(_pairs(cu), _pairs(cu_k)):
        mask = None
        if causal and ek - sk != e - s:
            mask = torch.ones(e - s, ek - sk, dtype=torch.bool, device=query.device).tril(ek - sk - (e - s))
        outs.append(
            F.scaled_dot_product_attention(
                query[:, :, s:e],
                key[:, :, sk:ek],
                value[:, :, sk:ek],
                attn_mask=mask,
                dropout_p=dropout,
                scale=scaling,
                is_causal=causal and mask is None,
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _pairs(cu: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def register_packed_attention() -> None:
    """Register "parallax_varlen" with transformers' attention and mask interfaces (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name in (ATTN_NAME, VISION_ATTN_NAME):
        AttentionInterface.register(name, varlen_attention)
        AttentionMaskInterface.register(name, sdpa_mask)
    _registered = True


def enable_packed_attention(model: nn.Module, vision: bool = True) -> None:
    """Route the text model's attention through "parallax_varlen" (SDPA whenever no cu_seqlens are given).

    With `vision`, the vision tower's attention too (one varlen call per block instead of one
    SDPA call per window); numerically the same.
    """
    register_packed_attention()
    model.config.text_config._attn_implementation = ATTN_NAME
    model.model.language_model.config._attn_implementation = ATTN_NAME
    if vision:
        set_vision_attention(model, VISION_ATTN_NAME)


def set_vision_attention(model: nn.Module, name: str) -> None:
    """Set the vision tower's attention implementation ("sdpa", VISION_ATTN_NAME, ...)."""
    model.config.vision_config._attn_implementation = name
    model.model.visual.config._attn_implementation = name


class PackedPolicy(nn.Module):
    """A Qwen2.5-VL or Qwen3-VL model scoring packed batches: forward(batch) -> (logprobs, entropy)."""

    def __init__(
        self,
        model: nn.Module,
        chunk_size: int = 1024,
        vision_varlen: bool = True,
        banned_token_ids: list[int] | None = None,
        compile_logprobs: bool = False,
        device: torch.device | None = None,
    ):
        """device: where the forward runs (default: where the model's weights are; pass the GPU for a model
        whose weights live in host memory and are streamed to it, learner/reference.offload_to_host).
        compile_logprobs: fuse each chunk's fp32 log-softmax / gather / entropy with torch.compile.
        banned_token_ids: tokens the generator never samples (default: the image and video pad tokens,
        which Parallax's vLLM sampler bans); their logits are masked out before the softmax so that the
        learner's distribution is exactly the one the behaviour logprobs came from. Pass [] to disable."""
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size
        self.image_token_id = model.config.image_token_id
        if banned_token_ids is None:
            banned_token_ids = [model.config.image_token_id, getattr(model.config, "video_token_id", None)]
        self.banned_token_ids = sorted({int(t) for t in banned_token_ids if t is not None})
        self.compile_logprobs = compile_logprobs
        self.compute_device = device
        enable_packed_attention(model, vision=vision_varlen)

    def forward(
        self,
        batch: PackedBatch,
        temperature: float = 1.0,
        with_entropy: bool = True,
        run_vision_always: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(N,) fp32 logprobs of the response tokens and (N,) fp32 entropies (None unless with_entropy).

        run_vision_always: run the vision tower on a dummy image (times zero) when the pack has no
        image, so every rank of a sharded model takes part in the same collectives.
        """
        hidden = self.hidden_states(batch, run_vision_always)
        source = batch.state_index if batch.state_index is not None else batch.target_index - 1
        states = hidden[0, source.to(hidden.device)]
        targets = batch.input_ids[0, batch.target_index].to(hidden.device)
        return chunked_logprobs(
            self.model.lm_head,
            states,
            targets,
            temperature,
            self.chunk_size,
            with_entropy,
            self.banned_token_ids,
            compiled=self.compile_logprobs,
        )

    def hidden_states(self, batch: PackedBatch, run_vision_always: bool = False) -> torch.Tensor:
        """(1, total, hidden) final hidden states of the packed row."""
        inner = self.model.model
        input_ids = batch.input_ids.to(self.compute_device or self.model.device)
        embeds = inner.get_input_embeddings()(input_ids)
        extra = {}
        if batch.pixel_values is not None:
            embeds, deepstack = self._insert_images(embeds, input_ids, batch)
            if deepstack:
                extra = dict(
                    visual_pos_masks=input_ids == self.image_token_id, deepstack_visual_embeds=deepstack
                )
        elif run_vision_always:
            embeds = embeds + 0.0 * self._dummy_vision(embeds)
        layer_types = getattr(inner.language_model.config, "layer_types", None)
        out = inner.language_model(
            inputs_embeds=embeds,
            position_ids=batch.position_ids.to(embeds.device),
            # Qwen2.5-VL takes prepared masks per layer type; Qwen3-VL builds none without padding
            attention_mask={t: None for t in set(layer_types)} if layer_types else None,
            use_cache=False,
            cu_seq_lens_q=batch.cu_seqlens.to(embeds.device),
            **_keys(batch, embeds.device),
            max_length_q=batch.max_seqlen,
            **extra,
        )
        return out.last_hidden_state

    def _insert_images(
        self, embeds: torch.Tensor, input_ids: torch.Tensor, batch: PackedBatch
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Embeddings with the image features scattered in, and the DeepStack features per decoder
        layer (Qwen3-VL; [] for Qwen2.5-VL), each (image tokens of the row, hidden) in row order."""
        inner = self.model.model
        pixels = batch.pixel_values.to(embeds.device, inner.visual.dtype)
        features = inner.get_image_features(pixels, batch.image_grid_thw.to(embeds.device), return_dict=True)
        index = batch.image_index.tolist() if batch.image_index is not None else None
        sizes = (batch.image_grid_thw.prod(-1) // inner.visual.spatial_merge_size**2).tolist()

        def in_row_order(features) -> torch.Tensor:
            per_image = split_per_image(features, sizes)
            if index is not None:  # distinct images encoded once, reused for every occurrence
                per_image = [per_image[i] for i in index]
            return torch.cat(per_image, dim=0).to(embeds.dtype)

        image_embeds = in_row_order(features.pooler_output)
        mask = input_ids == self.image_token_id
        if int(mask.sum()) != image_embeds.shape[0]:
            raise ValueError(f"{int(mask.sum())} image tokens but {image_embeds.shape[0]} image features")
        deepstack = [in_row_order(layer) for layer in getattr(features, "deepstack_features", None) or []]
        return embeds.masked_scatter(mask.unsqueeze(-1), image_embeds), deepstack

    def _dummy_vision(self, embeds: torch.Tensor) -> torch.Tensor:
        visual = self.model.model.visual
        merge = visual.spatial_merge_size
        cfg = self.model.config.vision_config
        dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        pixels = torch.zeros(merge * merge, dim, device=embeds.device, dtype=visual.dtype)
        grid = torch.tensor([[1, merge, merge]], device=embeds.device)
        out = self.model.model.get_image_features(pixels, grid, return_dict=True)
        total = torch.cat(out.pooler_output).sum()
        for layer in getattr(out, "deepstack_features", None) or []:  # Qwen3-VL: its mergers take part too
            total = total + torch.cat(split_per_image(layer, [1])).sum()  # one image, one merged token
        return total.to(embeds.dtype)


def _keys(batch: PackedBatch, device) -> dict:
    """The attention's key arguments: each piece's own tokens, or with shared prompts the gathered keys."""
    if batch.kv_index is None:
        return {"cu_seq_lens_k": batch.cu_seqlens.to(device), "max_length_k": batch.max_seqlen}
    return {
        "cu_seq_lens_k": batch.cu_seqlens_k.to(device),
        "max_length_k": batch.max_seqlen_k,
        "kv_index": batch.kv_index.to(device),
    }


def split_per_image(features, sizes: list[int]) -> list[torch.Tensor]:
    """Per-image feature blocks: transformers >= 5.19 splits Qwen3-VL's DeepStack features per image as it
    does the pooled ones; 5.17 returns them as one tensor of every image's tokens (split here by `sizes`)."""
    if isinstance(features, torch.Tensor):
        return list(torch.split(features, sizes))
    return list(features)


def chunked_logprobs(
    lm_head: nn.Module,
    states: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    banned_token_ids: list[int] | tuple[int, ...] = (),
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of `targets` (and entropies) from hidden `states` (N, d), `chunk_size` rows at a time.

    Tokens in `banned_token_ids` get no probability mass (as in a sampler that bans them).
    `compiled`: the per-chunk fp32 softmax work runs as fused torch.compile kernels."""
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    chunk_fn = _compiled_chunk() if compiled else _chunk
    logps, ents = [], []
    use_ckpt = torch.is_grad_enabled() and states.requires_grad
    for s, t in zip(torch.split(states, chunk_size), torch.split(targets, chunk_size)):
        if use_ckpt:
            lp, ent = checkpoint(
                chunk_fn,
                lm_head,
                s,
                t,
                temperature,
                with_entropy,
                tuple(banned_token_ids),
                use_reentrant=False,
            )
        else:
            lp, ent = chunk_fn(lm_head, s, t, temperature, with_entropy, tuple(banned_token_ids))
        logps.append(lp)
        ents.append(ent)
    logprobs = torch.cat(logps) if logps else states.new_zeros(0, dtype=torch.float32)
    entropy = torch.cat(ents) if with_entropy and ents else None
    return logprobs, entropy


def _chunk(lm_head, states, targets, temperature, with_entropy, banned=()):
    return _token_logp_entropy(lm_head(states), targets, temperature, with_entropy, banned)


def _compiled_chunk():
    """`_chunk` with the softmax part compiled (the lm_head matmul stays an eager mm)."""
    fused = _fused_logp_entropy()

    def chunk(lm_head, states, targets, temperature, with_entropy, banned=()):
        return fused(lm_head(states), targets, temperature, with_entropy, banned)

    return chunk


@functools.lru_cache(maxsize=1)
def _fused_logp_entropy():
    return torch.compile(_token_logp_entropy, dynamic=True)


def _token_logp_entropy(logits, targets, temperature, with_entropy, banned=()):
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if banned:
        # a finite minimum (not -inf) keeps p*log(p) at 0 instead of NaN in the entropy
        logits = logits.index_fill(
            -1, torch.tensor(banned, device=logits.device), torch.finfo(logits.dtype).min
        )
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else torch.zeros_like(token_logp)
    return token_logp, entropy


def packed_logprobs(
    model: nn.Module,
    batch: PackedBatch,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    banned_token_ids: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convenience: per-response-token (logprobs, entropy) of a PackedPolicy or a bare HF model."""
    if isinstance(model, PackedPolicy):
        policy = model
    else:
        policy = PackedPolicy(model, chunk_size, banned_token_ids=banned_token_ids)
    return policy(batch, temperature=temperature)
