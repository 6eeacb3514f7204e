"""Model shapes the builder knows, by name: toy presets and the published Qwen2.5-VL-3B/-7B.

Two model families, a preset's `family`: qwen2_5_vl and qwen3_vl (dense Qwen3-VL: patch size 16,
interleaved M-RoPE, q/k RMSNorm, DeepStack: features of early vision blocks added to the first
decoder layers). Everything downstream tells them apart by the checkpoint's config.json.

One copy of every shape used by the tests, the demo and the benches. `model_config(name)` turns
a preset into a transformers `Qwen2_5_VLConfig`; policy/builder.py builds random weights from it
(`build_model` in memory, `build_checkpoint` as a directory transformers and vLLM load).

    from policy.presets import PRESETS, model_config
    config = model_config("qwen2.5-vl-7b")   # published shapes, Qwen's vocabulary and token ids

Presets:
- tiny  (~1 M parameters, local 2k tokenizer): unit tests; builds in seconds.
- small (~5 M parameters, local 2k tokenizer): the CPU learning demo.
- learn-230m (~0.23 B parameters, local 2k tokenizer): the GPU learning run (deploy/configs/gpu_learn.toml):
  Qwen2.5-0.5B's text widths (hidden 896, 14 heads of 64, 2 KV heads, MLP 4864) at half its depth (12
  layers), and a Qwen2.5-VL vision tower at 1/2 width and 1/4 depth (8 blocks of 640, MLP 2.67x, windowed
  attention with full attention in blocks 3 and 7, as the published tower has in every 8th block).
- tiny-fullvocab: tiny widths with Qwen's whole vocabulary and token ids, so inputs written for the
  real models (image token 151655, ...) run on it; GPU tests and `--device cpu` bench runs.
- qwen3-vl-tiny, qwen3-vl-small: tiny and small as Qwen3-VL (tests; the demo with `--preset`).
- qwen3-vl-tiny-fullvocab: tiny-fullvocab as Qwen3-VL.
- qwen3-vl-4b, qwen3-vl-8b: Qwen3-VL-{4B,8B}-Instruct's config.json values (text and vision),
  for the GPU benches; tests/unit/policy/test_policy_presets.py checks them value by value.
- qwen2.5-vl-3b, qwen2.5-vl-7b: the published Qwen2.5-VL-{3B,7B}-Instruct config.json values
  (https://huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct/blob/main/config.json and
  https://huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct/blob/main/config.json), text and vision;
  tests/unit/policy/test_policy_presets.py checks them value by value.
"""

from __future__ import annotations

import dataclasses

QWEN_TOKEN_IDS = dict(
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)
"""Qwen2.5-VL's special token ids (published config.json; pad = <|endoftext|> as in its tokenizer)."""


FAMILIES = ("qwen2_5_vl", "qwen3_vl")
"""Model families (config.json model_type)."""


@dataclasses.dataclass(frozen=True)
class Preset:
    """Shapes of one Qwen2.5-VL or Qwen3-VL model."""

    hidden: int
    """Text model hidden size."""
    layers: int
    """Number of decoder layers."""
    heads: int
    """Attention heads (head_dim = hidden / heads)."""
    kv_heads: int
    """Key/value heads (grouped-query attention)."""
    ffn: int
    """MLP intermediate size."""
    vision_depth: int
    """Vision transformer blocks."""
    vision_hidden: int
    """Vision transformer width."""
    vision_heads: int
    """Vision attention heads."""
    vision_ffn: int
    """Vision MLP intermediate size."""
    vocab: int = 0
    """Model vocabulary with Qwen's token ids; 0: a locally trained tokenizer of `tokenizer_vocab` sets it."""
    tokenizer_vocab: int = 2048
    """Target BPE vocabulary of the local tokenizer, including the 22 added tokens (vocab = 0 only)."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output head (the published 3B does)."""
    fullatt_block_indexes: tuple[int, ...] = ()
    """Vision blocks with full (not windowed) attention; () means the last block only."""
    max_position_embeddings: int = 4096
    """Text model context length in the config."""
    dtype: str = "float32"
    """Weights dtype of a built checkpoint."""
    min_pixels: int = 56 * 56
    """Image processor lower bound on resized pixels."""
    max_pixels: int = 224 * 224
    """Image processor upper bound on resized pixels (224x224 -> 64 image tokens)."""
    family: str = "qwen2_5_vl"
    """Model family (FAMILIES)."""
    deepstack: tuple[int, ...] = ()
    """qwen3_vl: vision blocks whose features are added after decoder layers 0, 1, ... (DeepStack)."""
    vision_positions: int = 256
    """qwen3_vl: learned vision position embeddings (a square grid, interpolated to each image)."""
    head_dim: int = 0
    """Attention head width; 0 = hidden / heads (Qwen3-VL-4B sets 128 with hidden 2560 and 32 heads)."""


_QWEN_INPUTS = dict(vocab=151936, dtype="bfloat16", max_pixels=448 * 448)
"""Qwen's vocabulary and token ids, bf16 weights, images up to 448x448 (256 tokens): the presets that run
inputs written for the real models."""

_QWEN_VISION = dict(
    vision_depth=32,
    vision_hidden=1280,
    vision_heads=16,
    vision_ffn=3420,
    fullatt_block_indexes=(7, 15, 23, 31),
)
"""The vision tower shared by the published 3B and 7B (patch 14, temporal patch 2, merge 2, window 112)."""

_QWEN2_5_VL_PUBLISHED = dict(_QWEN_INPUTS, max_position_embeddings=128000, **_QWEN_VISION)
"""What the published Qwen2.5-VL-3B and -7B share (the 7B replaces the vocabulary)."""

_QWEN3_VL_PUBLISHED = dict(
    _QWEN_INPUTS,
    family="qwen3_vl",
    max_position_embeddings=262144,
    layers=36,
    heads=32,
    kv_heads=8,
    vision_heads=16,
    vision_positions=2304,
)
"""What the published Qwen3-VL-4B and -8B share."""

_TINY = Preset(
    hidden=128,
    layers=2,
    heads=4,
    kv_heads=2,
    ffn=256,
    vision_depth=2,
    vision_hidden=64,
    vision_heads=2,
    vision_ffn=128,
)
_SMALL = Preset(
    hidden=256,
    layers=4,
    heads=4,
    kv_heads=2,
    ffn=768,
    vision_depth=4,
    vision_hidden=128,
    vision_heads=4,
    vision_ffn=256,
)
_TINY_FULLVOCAB = Preset(
    **_QWEN_INPUTS,
    hidden=128,
    layers=2,
    heads=2,
    kv_heads=1,
    ffn=256,
    vision_depth=4,
    vision_hidden=64,
    vision_heads=2,
    vision_ffn=128,
    tie_word_embeddings=True,
    fullatt_block_indexes=(1, 3),
    max_position_embeddings=128000,
)


def _as_qwen3_vl(base: Preset, **changes) -> Preset:
    """`base` as a Qwen3-VL model (family qwen3_vl, no Qwen2.5-VL full-attention blocks), then `changes`."""
    return dataclasses.replace(base, family="qwen3_vl", fullatt_block_indexes=(), **changes)


PRESETS: dict[str, Preset] = {
    "tiny": _TINY,
    "small": _SMALL,
    "learn-230m": Preset(
        hidden=896,
        layers=12,
        heads=14,
        kv_heads=2,
        ffn=4864,
        vision_depth=8,
        vision_hidden=640,
        vision_heads=10,
        vision_ffn=1710,
        fullatt_block_indexes=(3, 7),
    ),
    "tiny-fullvocab": _TINY_FULLVOCAB,
    # 3 decoder layers: DeepStack's additions after layers 0 and 1 reach the logits
    "qwen3-vl-tiny": _as_qwen3_vl(_TINY, layers=3, vision_depth=3, deepstack=(0, 1)),
    "qwen3-vl-small": _as_qwen3_vl(_SMALL, deepstack=(1, 2)),
    # the benches' --device cpu check
    "qwen3-vl-tiny-fullvocab": _as_qwen3_vl(
        _TINY_FULLVOCAB, layers=3, vision_depth=3, deepstack=(0, 1), max_position_embeddings=262144
    ),
    # Qwen3-VL-{4B,8B}-Instruct config.json values (text and vision; vocab 151936 as Qwen3's tokenizer).
    "qwen3-vl-4b": Preset(
        **_QWEN3_VL_PUBLISHED,
        hidden=2560,
        head_dim=128,
        ffn=9728,
        tie_word_embeddings=True,
        vision_depth=24,
        vision_hidden=1024,
        vision_ffn=4096,
        deepstack=(5, 11, 17),
    ),
    "qwen3-vl-8b": Preset(
        **_QWEN3_VL_PUBLISHED,
        hidden=4096,
        ffn=12288,
        tie_word_embeddings=False,
        vision_depth=27,
        vision_hidden=1152,
        vision_ffn=4304,
        deepstack=(8, 16, 24),
    ),
    "qwen2.5-vl-3b": Preset(
        **_QWEN2_5_VL_PUBLISHED,
        hidden=2048,
        layers=36,
        heads=16,
        kv_heads=2,
        ffn=11008,
        tie_word_embeddings=True,
    ),
    "qwen2.5-vl-7b": Preset(
        **dict(_QWEN2_5_VL_PUBLISHED, vocab=152064),
        hidden=3584,
        layers=28,
        heads=28,
        kv_heads=4,
        ffn=18944,
        tie_word_embeddings=False,
    ),
}
"""Every preset by name. The published presets cap images at 448x448 (256 tokens), the benches' input."""


def get_preset(name: str) -> Preset:
    """The preset called `name`, or a ValueError listing the known ones."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]


def mrope_section(head_dim: int) -> list[int]:
    """Temporal/height/width split of rotary frequencies; sums to head_dim/2 (128 -> [16, 24, 24])."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def interleaved_mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's split for interleaved M-RoPE (frequency i goes to T, H, W by i % 3 up to the H and W
    counts, the rest to T); sums to head_dim/2 (128 -> [24, 20, 20], Qwen3-VL's)."""
    half = head_dim // 2
    hw = half * 5 // 16
    return [half - 2 * hw, hw, hw]


def model_config(
    name: str, vocab_size: int | None = None, token_ids: dict[str, int] | None = None, dtype: str = "bfloat16"
):
    """The `Qwen2_5_VLConfig` or `Qwen3VLConfig` (by the preset's family) of preset `name` (sdpa attention).

    `vocab_size` and `token_ids` default to the preset's vocabulary and Qwen's ids; a preset with a
    local tokenizer (vocab = 0) needs both, from that tokenizer (policy/builder.py passes them).
    """
    from transformers import Qwen2_5_VLConfig

    preset = get_preset(name)
    vocab_size = vocab_size or preset.vocab
    if not vocab_size:
        raise ValueError(f"preset {name!r} has a local tokenizer: pass vocab_size and token_ids from it")
    ids = dict(QWEN_TOKEN_IDS if token_ids is None else token_ids)
    if preset.family == "qwen3_vl":
        return _qwen3_vl_config(preset, vocab_size, ids, dtype)
    if preset.family != "qwen2_5_vl":
        raise ValueError(f"preset {name!r}: unknown family {preset.family!r}; choose from {FAMILIES}")
    text = dict(
        vocab_size=vocab_size,
        hidden_size=preset.hidden,
        intermediate_size=preset.ffn,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        rope_parameters={
            "rope_type": "default",
            "mrope_section": mrope_section(preset.hidden // preset.heads),
            "rope_theta": 1e6,
        },
        tie_word_embeddings=preset.tie_word_embeddings,
        use_sliding_window=False,
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        dtype=dtype,
    )
    vision = dict(
        depth=preset.vision_depth,
        hidden_size=preset.vision_hidden,
        num_heads=preset.vision_heads,
        intermediate_size=preset.vision_ffn,
        out_hidden_size=preset.hidden,
        hidden_act="silu",
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=list(preset.fullatt_block_indexes or [preset.vision_depth - 1]),
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=preset.tie_word_embeddings,
        dtype=dtype,
        attn_implementation="sdpa",
    )


def _qwen3_vl_config(preset: Preset, vocab_size: int, ids: dict[str, int], dtype: str):
    """`Qwen3VLConfig` (dense): explicit head_dim, q/k RMSNorm, interleaved M-RoPE, DeepStack, patch 16."""
    from transformers import Qwen3VLConfig

    head_dim = preset.head_dim or preset.hidden // preset.heads
    if len(preset.deepstack) > preset.layers or any(
        not 0 <= i < preset.vision_depth for i in preset.deepstack
    ):
        raise ValueError(
            f"DeepStack blocks {preset.deepstack} do not fit {preset.vision_depth} vision blocks"
        )
    text = dict(
        vocab_size=vocab_size,
        hidden_size=preset.hidden,
        intermediate_size=preset.ffn,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        head_dim=head_dim,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": interleaved_mrope_section(head_dim),
            "mrope_interleaved": True,
        },
        tie_word_embeddings=preset.tie_word_embeddings,
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        pad_token_id=ids["pad_token_id"],
        dtype=dtype,
    )
    vision = dict(
        depth=preset.vision_depth,
        hidden_size=preset.vision_hidden,
        num_heads=preset.vision_heads,
        intermediate_size=preset.vision_ffn,
        out_hidden_size=preset.hidden,
        hidden_act="gelu_pytorch_tanh",
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=preset.vision_positions,
        deepstack_visual_indexes=list(preset.deepstack),
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["image_token_id"],
        video_token_id=ids["video_token_id"],
        vision_start_token_id=ids["vision_start_token_id"],
        vision_end_token_id=ids["vision_end_token_id"],
        tie_word_embeddings=preset.tie_word_embeddings,
        dtype=dtype,
        attn_implementation="sdpa",
    )
