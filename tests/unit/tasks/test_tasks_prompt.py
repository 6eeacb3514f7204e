"""Prompt rendering: chat template, one pad per image, image-token arithmetic vs the real processor."""

from __future__ import annotations

import pytest
from PIL import Image

from tasks.prompt import (
    INSTRUCTION,
    build_messages,
    expanded_length,
    num_image_tokens,
    render_prompt_ids,
    render_prompt_text,
    with_instruction,
)


def test_instruction_is_think_then_boxed():
    text = with_instruction("  <image>Find x.  ")
    assert text.startswith("<image>Find x. You FIRST think")
    assert "<think> </think>" in INSTRUCTION and "\\boxed{}" in INSTRUCTION


def test_messages_place_images_at_placeholders_and_extra_images_first():
    msgs = build_messages("A<image>B<image>", 3)
    assert [c["type"] for c in msgs[0]["content"]] == ["image", "text", "image", "text", "image"]
    assert msgs[0]["content"][1]["text"] == "A"
    with pytest.raises(ValueError, match="placeholders"):
        build_messages("<image><image>", 1)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_prompt_ids_have_one_pad_per_image_inside_vision_markers(tiny_processor, n_images):
    tok = tiny_processor.tokenizer
    problem = "<image>" * n_images + "What colour is the shape?"
    ids = render_prompt_ids(tiny_processor, problem, n_images)
    pad, start, end = (
        tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    )
    positions = [i for i, t in enumerate(ids) if t == pad]
    assert len(positions) == n_images
    for p in positions:
        assert ids[p - 1] == start and ids[p + 1] == end
    assert tok.decode(ids) == render_prompt_text(tiny_processor, problem, n_images)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert render_prompt_ids(tok, problem, n_images) == ids  # a bare tokenizer renders the same


@pytest.mark.parametrize("size", [(224, 224), (112, 112), (30, 20), (640, 480), (1000, 90), (57, 300)])
def test_image_token_count_matches_the_processor(tiny_processor, size):
    image = Image.new("RGB", size, (10, 200, 30))
    problem = "<image>How many?"
    text = render_prompt_text(tiny_processor, problem, 1)
    enc = tiny_processor(text=[text], images=[image], return_tensors="pt")
    n_pad = int((enc["input_ids"] == tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert num_image_tokens(tiny_processor.image_processor, *size) == n_pad
    ids = render_prompt_ids(tiny_processor, problem, 1)
    assert expanded_length(len(ids), [size], tiny_processor.image_processor) == enc["input_ids"].shape[1]
