"""A procedurally generated visual task whose answer can only be read from the image.

Question types (`task`):
- "colour": one large shape; "What colour is the shape?" -> a colour word.
- "code":   the colour scene with a legend in the question ("Each colour stands for a number: red 1,
            green 2, ..."); the answer is the colour's number: a digit, graded by the math reward.
- "count":  1..max_count small shapes; "How many shapes are there?" -> a digit.
- "bigger": two shapes, left and right; "Which shape is bigger, left or right?" -> left/right.
- "more":   TWO images of 1..max_count small shapes each (different counts); "Which image has more
            shapes, the first or the second? Answer 1 or 2." -> 1/2 (a two-image prompt).
- "mixed":  one of the three one-image types per example.

Difficulty knobs: `n_colours` (palette size), `max_count`, `size_jitter` and `equal_area` (how
much the shapes of a "count" scene vary in size: with equal areas and little jitter the count can
be read off the covered area, which a randomly initialised model learns fastest), `size_margin`
(how much bigger the bigger shape is), `colour_jitter`, `image_size` (112 px -> 16 image tokens).
Every example is a pure function of (seed, split, index), so splits are reproducible and disjoint
streams.
`shuffle_images` is the control: each question gets the image of an independent scene of the
same type, so the answer cannot be read from the image and accuracy must stay at chance.

`verify(response_text, ground_truth)` is the task's pure verifier (the reward service calls it).

    python -m tasks synthetic --out data/shapes --train 2000 --test 64 --task colour
    python -m tasks synthetic --out data/two --task more     # two images per prompt
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from PIL import Image, ImageDraw

from broker.schemas import PromptRecord
from tasks.prompt import SHORT_INSTRUCTION
from tasks.records import ImagePut, RecordWriter, encode_png, make_record

log = logging.getLogger(__name__)

DATA_SOURCE = "synthetic"
PALETTE: list[tuple[str, tuple[int, int, int]]] = [
    ("red", (220, 40, 40)),
    ("green", (40, 170, 60)),
    ("blue", (40, 80, 220)),
    ("yellow", (235, 210, 40)),
    ("purple", (140, 60, 180)),
    ("orange", (245, 140, 30)),
    ("pink", (240, 120, 190)),
    ("cyan", (40, 200, 210)),
    ("brown", (120, 70, 30)),
    ("black", (20, 20, 20)),
]
KINDS = ("circle", "square", "triangle")
QUESTIONS = {
    "colour": "What colour is the shape?",
    "count": "How many shapes are there?",
    "bigger": "Which shape is bigger, left or right?",
    "more": "Which image has more shapes, the first or the second? Answer 1 or 2.",
    "code": "Each colour stands for a number: {legend}. Which number does the shape's colour stand for?",
}
MIXED = ("colour", "count", "bigger")
"""The question types "mixed" draws from (one image each)."""
SyntheticTask = Literal["colour", "code", "count", "bigger", "more", "mixed"]
"""Question types; "mixed" draws one of MIXED per example."""


@dataclasses.dataclass
class SyntheticConfig:
    """Options of the synthetic shapes task."""

    out: Path = Path("data/synthetic")
    """Task directory to write (records, images, manifest)."""
    task: SyntheticTask = "colour"
    """colour | code (the colour's number from a legend in the question: a numeric answer) | count | bigger |
    more (two images per prompt) | mixed."""
    train: int = 2000
    """Number of training prompts."""
    test: int = 64
    """Number of held-out prompts."""
    seed: int = 0
    """Seed of both splits (each split draws from its own stream)."""
    n_colours: int = 4
    """Palette size (2..10 for "colour", whose chance is 1/n_colours; 1..10 for the others: 1 = every shape
    red, so on "count" the covered red area, a linear image feature, gives the answer)."""
    max_count: int = 4
    """Largest count in "count" and "more" questions (1..9; "more" needs at least 2)."""
    size_jitter: float = 0.25
    """"count": each shape's radius is 0.6 x (cell half-width) x uniform(1 - size_jitter, 1 + size_jitter)."""
    equal_area: bool = False
    """"count": scale squares and triangles to a circle's area of the same radius."""
    size_margin: float = 0.5
    """"bigger": the bigger shape's size is at least (1 + size_margin) x the smaller one's."""
    colour_jitter: int = 20
    """Per-channel uniform jitter of shape colours."""
    image_size: int = 112
    """Square image side in pixels (112 -> 16 image tokens with Qwen2-VL's 28-px merged patches)."""
    shuffle_images: bool = False
    """Control: pair every question with the image(s) of an independent scene (answer unreadable)."""
    instruction: str = SHORT_INSTRUCTION
    """Appended to each question."""

    def validate(self) -> None:
        low_colours = 2 if self.task in ("colour", "code", "mixed") else 1
        if not low_colours <= self.n_colours <= len(PALETTE):
            raise ValueError(
                f"n_colours must be in {low_colours}..{len(PALETTE)} for task {self.task}, "
                f"got {self.n_colours}"
            )
        low = 2 if self.task == "more" else 1
        if not low <= self.max_count <= 9:
            raise ValueError(f"max_count must be in {low}..9 for task {self.task}, got {self.max_count}")
        if not 0 <= self.size_jitter < 0.5:
            raise ValueError(f"size_jitter must be in [0, 0.5), got {self.size_jitter}")
        if self.train < 0 or self.test < 0:
            raise ValueError("train and test must be >= 0")


@dataclasses.dataclass
class Example:
    """One generated example before it becomes a record."""

    images: list[Image.Image]
    """Its images, in the order the question refers to them."""
    question: str
    answer: str
    task: str

    @property
    def image(self) -> Image.Image:
        """The image of a one-image example."""
        if len(self.images) != 1:
            raise ValueError(f"a {self.task!r} example has {len(self.images)} images")
        return self.images[0]


def images_per_prompt(task: str) -> int:
    """How many images each prompt of a synthetic task variant carries."""
    return 2 if task == "more" else 1


def make_example(config: SyntheticConfig, split: str, index: int) -> Example:
    """The example at `index` of `split`: a pure function of the config's seed, the split and the index."""
    rng = random.Random(f"{config.seed}/{split}/{index}")
    task = rng.choice(MIXED) if config.task == "mixed" else config.task
    images, answer = _SCENES[task](rng, config)
    if config.shuffle_images:
        images, _ = _SCENES[task](random.Random(f"{config.seed}/{split}/{index}/decoy"), config)
    return Example(images=images, question=_question(task, config), answer=answer, task=task)


def _question(task: str, config: SyntheticConfig) -> str:
    if task != "code":
        return QUESTIONS[task]
    legend = ", ".join(f"{name} {i + 1}" for i, (name, _) in enumerate(PALETTE[: config.n_colours]))
    return QUESTIONS["code"].format(legend=legend)


def generate(
    config: SyntheticConfig, split: str, n: int, start: int = 0, put_image: ImagePut | None = None
) -> Iterator[tuple[PromptRecord, dict[str, bytes]]]:
    """Records (with their PNG bytes) for indices start..start+n-1 of `split`."""
    for index in range(start, start + n):
        ex = make_example(config, split, index)
        yield make_record(
            prompt_id=f"{DATA_SOURCE}-{config.task}-{split}-{index}",
            data_source=DATA_SOURCE,
            problem="<image>" * len(ex.images) + ex.question + config.instruction,
            images=[encode_png(image) for image in ex.images],
            ground_truth=ex.answer,
            split=split,
            put_image=put_image,
            meta={"task": ex.task, "shuffled": str(int(config.shuffle_images)), "seed": str(config.seed)},
        )


def write_task(config: SyntheticConfig) -> dict:
    """Write the train and test splits into `config.out`; returns the manifest dict."""
    with RecordWriter(config.out) as writer:
        for split, n in (("train", config.train), ("test", config.test)):
            for record, blobs in generate(config, split, n):
                writer.write(record, blobs)
        counts = dict(writer.counts)
        writer.close(
            extra={
                "data_source": DATA_SOURCE,
                "config": {k: str(v) for k, v in dataclasses.asdict(config).items()},
            }
        )
    log.info("synthetic %s: wrote %s to %s", config.task, counts, config.out)
    return {"records": counts}


_BOXED = re.compile(r"\\boxed\s*\{")
_WORDS = {
    "zero": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
    "first": "1",
    "second": "2",
    "grey": "gray",
    "colour": "color",
}


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i]
    return None


def normalise_answer(answer: str) -> str:
    """Lower-case, unwrap \\text{...}, drop spaces and trailing punctuation, words to digits."""
    answer = re.sub(r"\\text\s*\{([^{}]*)\}", r"\1", answer).strip().lower().strip(" .!$")
    answer = re.sub(r"\s+", " ", answer)
    if re.fullmatch(r"\d+\.0+", answer):
        answer = answer.split(".")[0]
    return _WORDS.get(answer, answer)


def verify(response_text: str, ground_truth: str) -> float:
    """1.0 if the last \\boxed{} of the response holds the ground truth (normalised), else 0.0."""
    boxed = last_boxed(response_text)
    if boxed is None:
        return 0.0
    return 1.0 if normalise_answer(boxed) == normalise_answer(ground_truth) else 0.0


def _canvas(rng: random.Random, config: SyntheticConfig) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    shade = 235 + rng.randint(-10, 10)
    image = Image.new("RGB", (config.image_size, config.image_size), (shade, shade, shade))
    return image, ImageDraw.Draw(image)


def _colour(rng: random.Random, config: SyntheticConfig) -> tuple[str, tuple[int, int, int]]:
    name, rgb = PALETTE[rng.randrange(config.n_colours)]
    j = config.colour_jitter
    return name, tuple(min(255, max(0, c + rng.randint(-j, j))) for c in rgb)


def _draw(draw: ImageDraw.ImageDraw, kind: str, cx: float, cy: float, r: float, fill) -> None:
    if kind == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif kind == "square":
        draw.rectangle([cx - r * 0.9, cy - r * 0.9, cx + r * 0.9, cy + r * 0.9], fill=fill)
    else:
        draw.polygon([(cx, cy - r), (cx - r * 0.95, cy + r * 0.8), (cx + r * 0.95, cy + r * 0.8)], fill=fill)


def _scene_colour(rng: random.Random, config: SyntheticConfig) -> tuple[list[Image.Image], str]:
    image, draw = _canvas(rng, config)
    s = config.image_size
    r = s * rng.uniform(0.22, 0.36)
    cx, cy = rng.uniform(r, s - r), rng.uniform(r, s - r)
    name, rgb = _colour(rng, config)
    _draw(draw, rng.choice(KINDS), cx, cy, r, rgb)
    return [image], name


def _scene_code(rng: random.Random, config: SyntheticConfig) -> tuple[list[Image.Image], str]:
    """The colour scene; the answer is the colour's 1-based place in the palette (the question's legend)."""
    images, name = _scene_colour(rng, config)
    return images, str([n for n, _ in PALETTE].index(name) + 1)


def _scene_count(rng: random.Random, config: SyntheticConfig) -> tuple[list[Image.Image], str]:
    image, k = _count_image(rng, config)
    return [image], str(k)


def _scene_more(rng: random.Random, config: SyntheticConfig) -> tuple[list[Image.Image], str]:
    """Two count scenes with different counts; the answer is which one (1 or 2) has more shapes."""
    counts = rng.sample(range(1, config.max_count + 1), 2)
    images = [_count_image(rng, config, k)[0] for k in counts]
    return images, "1" if counts[0] > counts[1] else "2"


def _count_image(
    rng: random.Random, config: SyntheticConfig, k: int | None = None
) -> tuple[Image.Image, int]:
    """A scene of `k` (None: 1..max_count at random) shapes, one per grid cell (none overlap): a 2x2 grid
    when max_count <= 4 (larger shapes), else 3x3."""
    image, draw = _canvas(rng, config)
    s = config.image_size
    k = rng.randint(1, config.max_count) if k is None else k
    g = 2 if config.max_count <= 4 else 3
    cells = rng.sample([(i, j) for i in range(g) for j in range(g)], k)  # one shape per cell: no overlap
    half = s / (2 * g)
    for i, j in cells:
        r = half * 0.6 * rng.uniform(1 - config.size_jitter, 1 + config.size_jitter)
        kind = rng.choice(KINDS)
        if config.equal_area:
            r *= _EQUAL_AREA[kind]
        cx = (2 * i + 1) * half + rng.uniform(-1, 1) * max(0.0, half - r)
        cy = (2 * j + 1) * half + rng.uniform(-1, 1) * max(0.0, half - r)
        _draw(draw, kind, cx, cy, r, _colour(rng, config)[1])
    return image, k


_EQUAL_AREA = {
    "circle": 1.0,
    "square": (math.pi / 1.8**2) ** 0.5,
    "triangle": (math.pi / (0.95 * 1.8)) ** 0.5,
}
"""Radius factors that give each kind (as `_draw` draws it) the area of a circle of the same radius."""


def _scene_bigger(rng: random.Random, config: SyntheticConfig) -> tuple[list[Image.Image], str]:
    image, draw = _canvas(rng, config)
    s = config.image_size
    big = s / 4 * rng.uniform(0.75, 0.95)
    small = big / (1 + config.size_margin) * rng.uniform(0.7, 1.0)
    left_is_big = rng.random() < 0.5
    kind = rng.choice(KINDS)
    for side, r in ((0, big if left_is_big else small), (1, small if left_is_big else big)):
        cx = s / 4 + side * s / 2 + rng.uniform(-1, 1) * (s / 4 - r)
        cy = s / 2 + rng.uniform(-1, 1) * (s / 2 - r) * 0.6
        _draw(draw, kind, cx, cy, r, _colour(rng, config)[1])
    return [image], "left" if left_is_big else "right"


_SCENES = {
    "colour": _scene_colour,
    "code": _scene_code,
    "count": _scene_count,
    "bigger": _scene_bigger,
    "more": _scene_more,
}
