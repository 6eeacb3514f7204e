"""The crop tool: a box comes back as the enlarged region; every bad call is an answer in words, counted by
kind, never an exception; the tool-call parser on what models write."""

from __future__ import annotations

import json

import pytest
from PIL import Image, ImageDraw

import envs
from envs.config import CropConfig, EnvConfig
from envs.crop import CropEnv
from envs.tools import parse_calls


def call(bbox, name="crop", **extra) -> str:
    body = json.dumps({"name": name, "arguments": {"bbox": bbox, **extra}})
    return f"<think>look closer</think><tool_call>{body}</tool_call>"


@pytest.fixture
def scene() -> Image.Image:
    image = Image.new("RGB", (200, 100), (255, 255, 255))
    ImageDraw.Draw(image).rectangle((150, 60, 159, 69), fill=(200, 0, 0))  # a 10 x 10 red patch
    return image


def env_for(scene, **config) -> CropEnv:
    env = envs.make("crop", EnvConfig(crop=CropConfig(**config)))
    env.reset(None, [scene])
    return env


def test_a_box_comes_back_enlarged_and_the_answer_ends_the_episode(scene):
    env = env_for(scene)
    step = env.step(call([150, 60, 160, 70]))
    assert not step.done and step.tool_calls == 1 and step.errors == []
    (crop,) = step.observation.images
    assert crop.mode == "RGB" and crop.size == (141, 141)  # about the image's 20,000 pixels
    assert crop.getpixel((70, 70)) == (200, 0, 0)  # the patch fills the crop
    assert "enlarged to 141x141" in step.observation.text
    final = env.step("<think>it is red</think> \\boxed{red}")
    assert final.done and final.observation is None and final.tool_calls == 0


def test_the_pixel_limits_bound_the_crop(scene):
    small = env_for(scene, max_pixels=28 * 28 * 4).step(call([0, 0, 200, 100])).observation.images[0]
    assert small.size[0] * small.size[1] <= 28 * 28 * 4 * 1.02 and abs(small.size[0] - 2 * small.size[1]) <= 1
    big = env_for(scene, crop_pixels=100, min_pixels=56 * 56).step(call([0, 0, 20, 20])).observation.images[0]
    assert big.size == (56, 56)


@pytest.mark.parametrize(
    "turn,kind,words",
    [
        ("<tool_call>{not json}</tool_call>", "malformed", "not valid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "malformed", "JSON object"),
        ('<tool_call>{"name": "crop", "arguments": [1]}</tool_call>', "malformed", "arguments"),
        ('<tool_call>{"name": "crop", "arguments": {"bbox": [0, 0, 5, 5]}}', "malformed", "not closed"),
        (call([0, 0, 50, 50], name="zoom"), "unknown_tool", 'no tool named "zoom"'),
        (call([0, 0, 50]), "bad_arguments", "four numbers"),
        (call(["a", 0, 50, 50]), "bad_arguments", "four numbers"),
        (call([True, 0, 50, 50]), "bad_arguments", "four numbers"),
        (call([0, 0, 50, 50], image="0"), "bad_arguments", "integer"),
        (call([0, 0, 50, 50], image=2), "out_of_range", "no image 2"),
        (call([0, 0, 250, 50]), "out_of_range", "200x100"),
        (call([-5, 0, 50, 50]), "out_of_range", "not inside"),
        (call([50, 50, 40, 60]), "out_of_range", "not inside"),
        (call([10, 10, 12, 12]), "too_small", "too small"),
        (call([0, 0, 200, 1.5]), "too_small", "too thin"),
    ],
)
def test_bad_calls_are_answered_and_counted_never_raised(scene, turn, kind, words):
    step = env_for(scene).step(turn)
    assert not step.done and step.errors == [kind] and step.tool_calls == 1
    assert step.observation.images == [] and step.observation.text.startswith("Error: ")
    assert words in step.observation.text


def test_too_many_calls_and_images_are_refused_without_running(scene):
    env = env_for(scene, max_calls=3, max_images=1)
    first = env.step(call([0, 0, 100, 100]) + call([100, 0, 200, 100]))  # two calls in one turn
    assert (
        first.tool_calls == 2 and first.errors == ["too_many_images"] and len(first.observation.images) == 1
    )
    second = env.step(call([0, 0, 50, 50]) + call([0, 0, 50, 50]))
    assert second.errors == ["too_many_images", "too_many_calls"] and second.observation.images == []
    assert "at most 3 tool calls" in second.observation.text


def test_the_parser_finds_every_block_in_order():
    text = 'a <tool_call>\n{"name": "crop", "arguments": "{\\"bbox\\": [1, 2, 3, 4]}"}\n</tool_call> b ' + (
        '<tool_call>{"name": "x", "arguments": {}}</tool_call>'
    )
    first, second = parse_calls(text)
    assert first.name == "crop" and first.arguments == {"bbox": [1, 2, 3, 4]} and not first.error
    assert second.name == "x" and second.arguments == {}
    assert parse_calls("no call here") == []
    huge = parse_calls("<tool_call>" + "[" * 5000 + "</tool_call>")
    assert huge[0].error == "malformed"


def test_an_unknown_environment_is_named():
    with pytest.raises(envs.UnknownEnvironment, match="nope"):
        envs.make("nope", EnvConfig())
