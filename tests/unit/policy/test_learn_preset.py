"""The GPU learning run's preset (learn-230m): realistic proportions at 0.23 B parameters, windowed
vision attention engaged on its 224 x 224 images. Built on the meta device (no weights)."""

from __future__ import annotations

import torch

from policy.builder import build_model
from policy.presets import QWEN_TOKEN_IDS, get_preset, model_config

LOCAL_IDS = {k: i for i, k in enumerate(QWEN_TOKEN_IDS)}
"""Token ids inside a 2k local vocabulary."""


def _model():
    config = model_config("learn-230m", vocab_size=2048, token_ids=LOCAL_IDS, dtype="float32")
    return build_model("learn-230m", "meta", torch.float32, config=config)


def test_learn_preset_is_a_quarter_billion_parameters_with_a_fifth_in_vision():
    model = _model()
    total = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    assert 0.2e9 < total < 0.26e9
    assert 0.15 < vision / total < 0.25
    preset = get_preset("learn-230m")
    assert preset.hidden // preset.heads == 64 and preset.heads // preset.kv_heads == 7


def test_a_224_pixel_image_spans_four_attention_windows():
    visual = _model().model.visual
    grid = torch.tensor([[1, 224 // 14, 224 // 14]])
    try:  # transformers >= 5.19: a function of vision_utils; before: a method of the vision tower
        from transformers.vision_utils import get_vision_window_index

        _, cu_window = get_vision_window_index(
            grid, spatial_merge_size=2, window_size=visual.window_size, patch_size=14
        )
    except ImportError:
        _, cu_window = visual.get_window_index(grid)
    assert len(torch.unique_consecutive(torch.tensor(cu_window))) - 1 == 4
    assert visual.fullatt_block_indexes == [3, 7]
