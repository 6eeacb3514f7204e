"""PromptChecker: the expanded length matches the processor's, and every bad prompt gets its reason."""

from __future__ import annotations

import pytest
from PIL import Image

from generator.inputs import PromptChecker, Request
from tasks.prompt import render_prompt_ids, render_prompt_text


@pytest.fixture(scope="module")
def ids_of(tiny_processor):
    return lambda problem, n: render_prompt_ids(tiny_processor, problem, n)


def checker(processor, max_prompt_len=200, max_images=2) -> PromptChecker:
    tok = processor.tokenizer
    return PromptChecker(
        processor.image_processor,
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"),
        max_prompt_len=max_prompt_len,
        max_images=max_images,
    )


@pytest.mark.parametrize("sizes", [[(224, 224)], [(100, 60), (60, 140)], [(500, 300)], []])
def test_expanded_length_equals_the_processors(tiny_processor, ids_of, sizes):
    images = [Image.new("RGB", s) for s in sizes]
    problem = "<image>" * len(images) + " How many?"
    enc = tiny_processor(
        text=[render_prompt_text(tiny_processor, problem, len(images))], images=images or None
    )
    length, reason = checker(tiny_processor, max_prompt_len=10_000).check(
        Request(ids_of(problem, len(images)), images)
    )
    assert reason is None and length == len(enc["input_ids"][0])


def test_reasons(tiny_processor, ids_of):
    c = checker(tiny_processor, max_prompt_len=100, max_images=2)
    img = Image.new("RGB", (224, 224))  # 64 image tokens
    one = ids_of("<image> Hi", 1)
    assert c.check(Request(one, [img]))[1] is None
    assert c.check(Request(one, []))[1] == "image_count_mismatch"
    assert c.check(Request(one, [img, img]))[1] == "image_count_mismatch"
    assert c.check(Request(ids_of("<image><image><image> Hi", 3), [img] * 3))[1] == "too_many_images"
    assert c.check(Request(ids_of("<image><image> Hi", 2), [img, img]))[1] == "too_long"  # 2 x 64 > 100
    assert c.check(Request([], []))[1] == "empty_prompt"
    assert c.check(Request(one + [c.video_token_id], [img]))[1] == "video_pad"
    assert c.check(Request(one, [Image.new("RGB", (1000, 2))]))[1] == "bad_image"  # aspect ratio > 200


def test_an_image_count_mismatch_is_described_with_the_prompt_id_and_both_counts(tiny_processor, ids_of):
    c = checker(tiny_processor)
    img = Image.new("RGB", (112, 112))
    two = Request(ids_of("<image><image> Which has more?", 2), [img], prompt_id="synthetic-more-train-3")
    length, reason = c.check(two)
    assert reason == "image_count_mismatch"
    assert c.describe(two, reason, length) == (
        "prompt synthetic-more-train-3: 2 image pads in the prompt ids but 1 images"
    )
    assert c.check(Request(two.prompt_token_ids, [img, img]))[1] is None
