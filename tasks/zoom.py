"""A task where looking closer pays: a small colour patch in a large image, too small to see at the image
processor's resolution unless the model crops around it (the crop tool, envs/crop.py).

Each example is a large grey canvas with faint noise and a few decoys; at a random place sits a small
square (`patch` pixels) of one of `n_colours` colours, drawn as a fine checkerboard of that colour and
white, inside a thin dark frame. The question gives the image's size and roughly where the square is
("near (x, y)", within `hint_jitter` pixels) and asks for its colour. At `max_pixels` of the model's
processor the image is shrunk by (image side / sqrt(max_pixels)), and the patch, averaged with white and
its frame, becomes a pale smear a pixel or two wide; a crop of a box around the hint, enlarged, shows it
plainly. The record's meta names the environment ("env": "crop"), so the generator runs it as an episode,
and the reward is the synthetic task's (the last \\boxed{} equals the colour word).

`tool_free` writes the same questions without the tool's instruction and without the environment: the
control run (the same images, one turn).

    python -m tasks zoom --out data/zoom --train 2000 --test 64
    python -m tasks zoom --out data/zoom-control --tool-free
"""

from __future__ import annotations

import dataclasses
import logging
import random
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from tasks.prompt import SHORT_INSTRUCTION
from tasks.records import RecordWriter, encode_png, make_record
from tasks.synthetic import PALETTE

log = logging.getLogger(__name__)
DATA_SOURCE = "zoom"
TOOL_INSTRUCTION = (
    " You may look closer first: write"
    ' <tool_call>{"name": "crop", "arguments": {"bbox": [x1, y1, x2, y2]}}</tool_call>'
    " with a box in pixels of the image, and you will see that region enlarged."
)


@dataclasses.dataclass
class ZoomConfig:
    """Options of the zoom task."""

    out: Path = Path("data/zoom")
    """Task directory to write (records, images, manifest)."""
    train: int = 2000
    """Training prompts."""
    test: int = 64
    """Held-out prompts."""
    seed: int = 0
    """Seed of both splits (each split draws from its own stream)."""
    image_size: int = 896
    """Square image side in pixels (4x the side of the small preset's 224-pixel limit)."""
    patch: int = 12
    """Side of the colour square in pixels."""
    n_colours: int = 4
    """Colours the square may have (chance = 1 / n_colours)."""
    decoys: int = 6
    """Grey squares of the same size elsewhere (the hint says which square is meant)."""
    hint_jitter: int = 16
    """The hint names a point within this many pixels of the square's centre."""
    tool_free: bool = False
    """Control: no tool instruction and no environment (one-turn prompts, the same images)."""

    def validate(self) -> None:
        if not 2 <= self.n_colours <= len(PALETTE):
            raise ValueError(f"n_colours must be in 2..{len(PALETTE)}, got {self.n_colours}")
        if not 4 <= self.patch <= self.image_size // 8:
            raise ValueError(f"patch must be in 4..{self.image_size // 8}, got {self.patch}")


def make_example(config: ZoomConfig, split: str, index: int) -> tuple[Image.Image, str, tuple[int, int]]:
    """(image, colour word, hinted point) of example `index` of `split`: a pure function of them."""
    rng = random.Random(f"zoom/{config.seed}/{split}/{index}")
    size, p = config.image_size, config.patch
    noise = np.random.default_rng(rng.getrandbits(64)).integers(0, 24, (size, size, 1), dtype=np.uint8)
    image = Image.fromarray(np.repeat(noise + 130, 3, axis=2), "RGB")
    draw = ImageDraw.Draw(image)
    margin = 2 * p
    spots = [
        (rng.randrange(margin, size - margin), rng.randrange(margin, size - margin))
        for _ in range(1 + config.decoys)
    ]
    name, rgb = PALETTE[rng.randrange(config.n_colours)]
    for k, (x, y) in enumerate(spots):
        draw.rectangle((x - p // 2 - 2, y - p // 2 - 2, x + p // 2 + 1, y + p // 2 + 1), outline=(40, 40, 40))
        fill = rgb if k == 0 else (150, 150, 150)
        for dx in range(p):
            for dy in range(p):
                if (dx + dy) % 2 == 0:
                    image.putpixel((x - p // 2 + dx, y - p // 2 + dy), fill)
                else:
                    image.putpixel((x - p // 2 + dx, y - p // 2 + dy), (255, 255, 255))
    j = config.hint_jitter
    hint = (spots[0][0] + rng.randint(-j, j), spots[0][1] + rng.randint(-j, j))
    return image, name, hint


def question(config: ZoomConfig, hint: tuple[int, int]) -> str:
    size = config.image_size
    text = (
        f"<image>The image is {size}x{size} pixels. A small checkered square near ({hint[0]}, {hint[1]}) "
        "has a colour. Which colour is it?"
    )
    if not config.tool_free:
        text += TOOL_INSTRUCTION
    return text + SHORT_INSTRUCTION


def write_task(config: ZoomConfig) -> dict:
    """Write the train and test splits into `config.out`; returns the manifest dict."""
    config.validate()
    with RecordWriter(config.out) as writer:
        for split, n in (("train", config.train), ("test", config.test)):
            for index in range(n):
                image, answer, hint = make_example(config, split, index)
                meta = {"hint": f"{hint[0]},{hint[1]}"}
                if not config.tool_free:
                    meta["env"] = "crop"
                writer.write(
                    *make_record(
                        prompt_id=f"{DATA_SOURCE}-{split}-{index}",
                        data_source=DATA_SOURCE,
                        problem=question(config, hint),
                        images=[encode_png(image)],
                        ground_truth=answer,
                        split=split,
                        meta=meta,
                    )
                )
        counts = dict(writer.counts)
        writer.close(
            extra={
                "data_source": DATA_SOURCE,
                "config": {k: str(v) for k, v in dataclasses.asdict(config).items()},
            }
        )
    log.info("zoom: wrote %s to %s", counts, config.out)
    return {"records": counts}
