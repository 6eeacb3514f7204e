"""The crop/zoom tool: the model asks for a region of its image and gets it back enlarged, as a new image.

The model calls it in Qwen's tool-call format (envs/tools.py):

    <tool_call>{"name": "crop", "arguments": {"bbox": [x1, y1, x2, y2]}}</tool_call>

with the box in pixels of the prompt's image (x to the right, y down, x1 < x2, y1 < y2; "image": k picks
the k-th image of a prompt with several, from 0). The region is cut out and resized, keeping its aspect
ratio, to about `crop_pixels` pixels (by default as many as the whole image has: a box of a quarter of the
image's side comes back four times larger), within the image processor's pixel limits; the model sees it
in the next turn. A turn without a tool call is the model's answer and ends the episode.

Nothing the model writes raises: each refused call is counted by kind and answered in words —
    malformed       not a JSON object with "name" and "arguments" (envs/tools.py)
    unknown_tool    a name other than "crop"
    bad_arguments   no bbox of four finite numbers, or an image index that is not an integer
    out_of_range    a box outside the image, an empty box, or no such image
    too_small       a box side below `min_side` pixels, or a box more than 100 times longer than wide
    too_many_calls  more than `max_calls` calls in the episode (the call is not run)
    too_many_images more than `max_images` crops in the episode
"""

from __future__ import annotations

import math

from envs.base import Environment, Observation, Step
from envs.config import CropConfig, EnvConfig
from envs.tools import parse_calls

TOOL = {
    "type": "function",
    "function": {
        "name": "crop",
        "description": "Crop a region of the image and see it enlarged.",
        "parameters": {
            "type": "object",
            "properties": {
                "bbox": {
                    "type": "array",
                    "items": {"type": "number"},
                    "description": "[x1, y1, x2, y2]: the region in pixels of the image",
                },
                "image": {"type": "integer", "description": "which image of the prompt, from 0 (default 0)"},
            },
            "required": ["bbox"],
        },
    },
}
"""The tool's schema, for a task that lists it in its system prompt (Qwen's `tools=` of the chat template)."""
MAX_ASPECT = 100


def make(config: EnvConfig) -> CropEnv:
    return CropEnv(config.crop)


class CropEnv(Environment):
    """One episode of the crop tool (module docstring)."""

    def __init__(self, config: CropConfig):
        self.config = config
        self.images: list = []
        self.calls = self.crops = 0

    def reset(self, record, images: list) -> None:
        self.images = list(images)
        self.calls = self.crops = 0

    def step(self, turn: str) -> Step:
        calls = parse_calls(turn)
        if not calls:
            return Step(done=True)
        images, lines, errors = [], [], []
        for call in calls:
            self.calls += 1
            if self.calls > self.config.max_calls:
                kind, text = "too_many_calls", f"at most {self.config.max_calls} tool calls: answer now"
            elif call.error:
                kind, text = call.error, call.detail
            elif call.name != "crop":
                kind, text = "unknown_tool", f'no tool named "{call.name[:40]}"; the tool is "crop"'
            elif self.crops >= self.config.max_images:
                kind, text = "too_many_images", f"at most {self.config.max_images} crops: answer now"
            else:
                kind, text, image = self.crop(call.arguments)
                if image is not None:
                    images.append(image)
                    self.crops += 1
            if kind:
                errors.append(kind)
                text = f"Error: {text}."
            lines.append(text)
        return Step(Observation(text="\n".join(lines), images=images), tool_calls=len(calls), errors=errors)

    def crop(self, arguments: dict) -> tuple[str, str, object]:
        """(error kind or "", text, the crop or None) of one call's arguments."""
        index = arguments.get("image", 0)
        if isinstance(index, bool) or not isinstance(index, int):
            return "bad_arguments", '"image" must be an integer', None
        if not 0 <= index < len(self.images):
            return "out_of_range", f"there is no image {index} (the prompt has {len(self.images)})", None
        box = arguments.get("bbox")
        if not _numbers(box, 4):
            return "bad_arguments", '"bbox" must be [x1, y1, x2, y2], four numbers', None
        image = self.images[index]
        width, height = image.size
        x1, y1, x2, y2 = (float(v) for v in box)
        if not (0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height):
            return "out_of_range", f"bbox {_fmt(box)} is not inside the {width}x{height} image", None
        left, top, right, bottom = math.floor(x1), math.floor(y1), math.ceil(x2), math.ceil(y2)
        w, h = right - left, bottom - top
        if min(w, h) < self.config.min_side or max(w, h) > MAX_ASPECT * min(w, h):
            return "too_small", f"bbox {_fmt(box)} is too small or too thin to crop", None
        size = self.output_size(w, h, width * height)
        region = image.crop((left, top, right, bottom)).convert("RGB").resize(size, resample=3)  # bicubic
        text = f"Crop of bbox {_fmt(box)} of image {index}, enlarged to {size[0]}x{size[1]}."
        return "", text, region

    def output_size(self, w: int, h: int, image_pixels: int) -> tuple[int, int]:
        """The crop's size: about `crop_pixels` pixels (0: the image's), within [min_pixels, max_pixels]."""
        target = self.config.crop_pixels or image_pixels
        if self.config.max_pixels:
            target = min(target, self.config.max_pixels)
        if self.config.min_pixels:
            target = max(target, self.config.min_pixels)
        scale = math.sqrt(target / (w * h))
        return max(1, round(w * scale)), max(1, round(h * scale))


def _numbers(value, n: int) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) == n
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    )


def _fmt(box) -> str:
    if not isinstance(box, (list, tuple)):
        return "?"
    return "[" + ", ".join(f"{v:g}" if isinstance(v, (int, float)) else "?" for v in box[:4]) + "]"
