"""The presets against the published Qwen2.5-VL-{3B,7B}- and Qwen3-VL-{4B,8B}-Instruct config.json values.

PUBLISHED copies the values of https://huggingface.co/Qwen/Qwen2.5-VL-3B-Instruct/blob/main/config.json,
https://huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct/blob/main/config.json and the Qwen3-VL-4B/-8B ones
by hand (text part at the top level there, vision part under "vision_config"), so a wrong preset fails
here; EVERY_PRESET holds every field of every preset, so sharing values in policy/presets.py moves none.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policy.builder import build_model
from policy.presets import PRESETS, QWEN_TOKEN_IDS, Preset, get_preset, model_config

_VISION = dict(
    depth=32,
    hidden_act="silu",
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    in_channels=3,
    patch_size=14,
    spatial_merge_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
    temporal_patch_size=2,
)
_TEXT = dict(
    hidden_act="silu",
    max_position_embeddings=128000,
    rms_norm_eps=1e-06,
    use_sliding_window=False,
)
_QWEN2_5 = dict(config="Qwen2_5_VLConfig", rope=dict(mrope_section=[16, 24, 24], rope_theta=1e6))
_QWEN3 = dict(
    config="Qwen3VLConfig", rope=dict(mrope_section=[24, 20, 20], mrope_interleaved=True, rope_theta=5e6)
)
PUBLISHED = {
    "qwen2.5-vl-3b": dict(
        text=dict(
            _TEXT,
            hidden_size=2048,
            intermediate_size=11008,
            num_attention_heads=16,
            num_hidden_layers=36,
            num_key_value_heads=2,
            vocab_size=151936,
        ),
        vision=dict(_VISION, out_hidden_size=2048),
        tie_word_embeddings=True,
        **_QWEN2_5,
    ),
    "qwen2.5-vl-7b": dict(
        text=dict(
            _TEXT,
            hidden_size=3584,
            intermediate_size=18944,
            num_attention_heads=28,
            num_hidden_layers=28,
            num_key_value_heads=4,
            vocab_size=152064,
        ),
        vision=dict(_VISION, out_hidden_size=3584),
        tie_word_embeddings=False,
        **_QWEN2_5,
    ),
}


_QWEN3_VISION = dict(
    hidden_act="gelu_pytorch_tanh",
    in_channels=3,
    num_heads=16,
    num_position_embeddings=2304,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
)
_QWEN3_TEXT = dict(
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=262144,
    num_attention_heads=32,
    num_hidden_layers=36,
    num_key_value_heads=8,
    rms_norm_eps=1e-06,
    vocab_size=151936,
)
PUBLISHED |= {
    "qwen3-vl-4b": dict(
        text=dict(_QWEN3_TEXT, hidden_size=2560, intermediate_size=9728),
        vision=dict(
            _QWEN3_VISION,
            depth=24,
            hidden_size=1024,
            intermediate_size=4096,
            out_hidden_size=2560,
            deepstack_visual_indexes=[5, 11, 17],
        ),
        tie_word_embeddings=True,
        **_QWEN3,
    ),
    "qwen3-vl-8b": dict(
        text=dict(_QWEN3_TEXT, hidden_size=4096, intermediate_size=12288),
        vision=dict(
            _QWEN3_VISION,
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            out_hidden_size=4096,
            deepstack_visual_indexes=[8, 16, 24],
        ),
        tie_word_embeddings=False,
        **_QWEN3,
    ),
}
"""Qwen3-VL-{4B,8B}-Instruct config.json values (huggingface.co/Qwen/Qwen3-VL-8B-Instruct, -4B-Instruct)."""


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_presets_match_the_published_config(name):
    config = model_config(name)
    want = PUBLISHED[name]
    assert type(config).__name__ == want["config"]
    for key, value in want["text"].items():
        assert getattr(config.text_config, key) == value, key
    for key, value in want["vision"].items():
        assert getattr(config.vision_config, key) == value, key
    assert config.tie_word_embeddings == want["tie_word_embeddings"]
    assert config.text_config.tie_word_embeddings == want["tie_word_embeddings"]
    rope = config.text_config.rope_parameters
    for key, value in want["rope"].items():
        assert rope[key] == value, key
    for key, value in QWEN_TOKEN_IDS.items():
        owner = config.text_config if key in ("bos_token_id", "eos_token_id", "pad_token_id") else config
        assert getattr(owner, key) == value, key


@pytest.mark.parametrize(
    "name,total",
    [
        ("qwen2.5-vl-3b", 3_754_622_976),
        ("qwen2.5-vl-7b", 8_292_166_656),
        ("qwen3-vl-4b", 4_437_815_808),
        ("qwen3-vl-8b", 8_767_123_696),
    ],
)
def test_published_presets_have_the_published_parameter_count(name, total):
    """The parameter counts the model cards list (Qwen2.5-VL: 3.75 B, 8.29 B) and those of the published
    safetensors (Qwen3-VL: 4.44 B, 8.77 B), built on the meta device."""
    model = build_model(name, "meta", torch.bfloat16)
    assert sum(p.numel() for p in model.parameters()) == total


_SHAPE = (
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "ffn",
    "vision_depth",
    "vision_hidden",
    "vision_heads",
    "vision_ffn",
)
_QWEN_INPUTS = dict(vocab=151936, dtype="bfloat16", max_pixels=448 * 448)
_QWEN3 = dict(family="qwen3_vl")
_QWEN3_FULLVOCAB = dict(_QWEN_INPUTS, **_QWEN3, max_position_embeddings=262144)
_QWEN2_5_PUBLISHED = dict(_QWEN_INPUTS, max_position_embeddings=128000, fullatt_block_indexes=(7, 15, 23, 31))
EVERY_PRESET = {
    "tiny": ((128, 2, 4, 2, 256, 2, 64, 2, 128), {}),
    "small": ((256, 4, 4, 2, 768, 4, 128, 4, 256), {}),
    "learn-230m": ((896, 12, 14, 2, 4864, 8, 640, 10, 1710), dict(fullatt_block_indexes=(3, 7))),
    "tiny-fullvocab": (
        (128, 2, 2, 1, 256, 4, 64, 2, 128),
        dict(
            _QWEN_INPUTS,
            tie_word_embeddings=True,
            fullatt_block_indexes=(1, 3),
            max_position_embeddings=128000,
        ),
    ),
    "qwen3-vl-tiny": ((128, 3, 4, 2, 256, 3, 64, 2, 128), dict(_QWEN3, deepstack=(0, 1))),
    "qwen3-vl-small": ((256, 4, 4, 2, 768, 4, 128, 4, 256), dict(_QWEN3, deepstack=(1, 2))),
    "qwen3-vl-tiny-fullvocab": (
        (128, 3, 2, 1, 256, 3, 64, 2, 128),
        dict(_QWEN3_FULLVOCAB, tie_word_embeddings=True, deepstack=(0, 1)),
    ),
    "qwen3-vl-4b": (
        (2560, 36, 32, 8, 9728, 24, 1024, 16, 4096),
        dict(
            _QWEN3_FULLVOCAB,
            head_dim=128,
            tie_word_embeddings=True,
            deepstack=(5, 11, 17),
            vision_positions=2304,
        ),
    ),
    "qwen3-vl-8b": (
        (4096, 36, 32, 8, 12288, 27, 1152, 16, 4304),
        dict(_QWEN3_FULLVOCAB, deepstack=(8, 16, 24), vision_positions=2304),
    ),
    "qwen2.5-vl-3b": (
        (2048, 36, 16, 2, 11008, 32, 1280, 16, 3420),
        dict(_QWEN2_5_PUBLISHED, tie_word_embeddings=True),
    ),
    "qwen2.5-vl-7b": ((3584, 28, 28, 4, 18944, 32, 1280, 16, 3420), dict(_QWEN2_5_PUBLISHED, vocab=152064)),
}
"""Every field of every preset: the _SHAPE values, then those that differ from Preset's defaults (also the
ones config.json does not show: dtype, max_pixels, the toy presets)."""


def test_the_table_lists_every_preset():
    assert list(EVERY_PRESET) == list(PRESETS)


@pytest.mark.parametrize("name", list(EVERY_PRESET))
def test_every_preset_keeps_every_value(name):
    """The blocks policy/presets.py shares between presets must not move a value (defaults included)."""
    shape, rest = EVERY_PRESET[name]
    defaults = {f.name: f.default for f in dataclasses.fields(Preset) if f.default is not dataclasses.MISSING}
    assert dataclasses.asdict(PRESETS[name]) == {**defaults, **dict(zip(_SHAPE, shape)), **rest}


def test_every_preset_builds_a_consistent_config():
    for name, preset in PRESETS.items():
        config = model_config(name, vocab_size=preset.vocab or 2048, token_ids=QWEN_TOKEN_IDS)
        head_dim = preset.head_dim or preset.hidden // preset.heads
        assert sum(config.text_config.rope_parameters["mrope_section"]) == head_dim // 2
        assert config.vision_config.out_hidden_size == preset.hidden
        assert preset.heads % preset.kv_heads == 0


def test_local_tokenizer_presets_need_a_vocabulary_and_unknown_names_fail():
    with pytest.raises(ValueError, match="local tokenizer"):
        model_config("tiny")
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("qwen2.5-vl-72b")
