"""The synthetic shapes task: answers readable from the image, determinism, splits, control, verifier."""

from __future__ import annotations

import collections
import io

import pytest
from PIL import Image

from tasks.records import read_records
from tasks.synthetic import PALETTE, SyntheticConfig, generate, last_boxed, make_example, verify, write_task


def _foreground(image):
    bg = image.getpixel((0, 0))
    w, h = image.size
    return [
        (x, y, image.getpixel((x, y)))
        for y in range(h)
        for x in range(w)
        if max(abs(a - b) for a, b in zip(image.getpixel((x, y)), bg)) > 25
    ]


def test_colour_answer_is_the_drawn_colour():
    config = SyntheticConfig(task="colour", n_colours=6)
    for i in range(20):
        ex = make_example(config, "train", i)
        pixels = [p for _, _, p in _foreground(ex.image)]
        mean = [sum(c[k] for c in pixels) / len(pixels) for k in range(3)]
        nearest = min(PALETTE[:6], key=lambda item: sum((a - b) ** 2 for a, b in zip(item[1], mean)))[0]
        assert nearest == ex.answer


def test_bigger_answer_matches_pixel_mass_and_count_is_in_range():
    config = SyntheticConfig(task="bigger")
    half = config.image_size / 2
    for i in range(10):
        ex = make_example(config, "train", i)
        fg = _foreground(ex.image)
        left = sum(1 for x, _, _ in fg if x < half)
        assert ("left" if left > len(fg) - left else "right") == ex.answer
    counts = {make_example(SyntheticConfig(task="count", max_count=3), "test", i).answer for i in range(40)}
    assert counts == {"1", "2", "3"}


def test_examples_are_deterministic_and_splits_differ():
    config = SyntheticConfig(task="mixed")
    a = make_example(config, "train", 5)
    assert a.image.tobytes() == make_example(config, "train", 5).image.tobytes()
    assert a.image.tobytes() != make_example(config, "test", 5).image.tobytes()
    assert (
        a.image.tobytes() != make_example(SyntheticConfig(task="mixed", seed=1), "train", 5).image.tobytes()
    )
    assert {make_example(config, "train", i).task for i in range(30)} == {"colour", "count", "bigger"}


def test_answers_are_balanced_over_the_palette():
    answers = collections.Counter(
        make_example(SyntheticConfig(n_colours=4), "train", i).answer for i in range(400)
    )
    assert set(answers) == {"red", "green", "blue", "yellow"}
    assert min(answers.values()) > 60


def test_shuffled_control_keeps_questions_and_answers_but_changes_images():
    plain, control = SyntheticConfig(), SyntheticConfig(shuffle_images=True)
    same = 0
    for i in range(40):
        a, b = make_example(plain, "train", i), make_example(control, "train", i)
        assert (a.question, a.answer) == (b.question, b.answer)
        assert a.image.tobytes() != b.image.tobytes()
        same += _drawn_colour(b.image) == b.answer
    assert same < 20  # about chance (1/4), far from always


def _drawn_colour(image):
    pixels = [p for _, _, p in _foreground(image)]
    mean = [sum(c[k] for c in pixels) / len(pixels) for k in range(3)]
    return min(PALETTE[:4], key=lambda item: sum((a - b) ** 2 for a, b in zip(item[1], mean)))[0]


def test_records_and_task_dir(tmp_path, tiny_processor):
    config = SyntheticConfig(out=tmp_path, task="count", train=5, test=3)
    assert write_task(config) == {"records": {"train": 5, "test": 3}}
    train = list(read_records(tmp_path, "train"))
    assert len(train) == 5 and train[0].problem.startswith("<image>How many shapes are there?")
    assert train[0].data_source == "synthetic" and train[0].images[0].width == 112
    record, blobs = next(generate(config, "test", 1))
    image = Image.open(io.BytesIO(blobs[record.images[0].sha256]))
    assert image.size == (112, 112)
    from tasks.prompt import expanded_length, render_prompt_ids

    ids = render_prompt_ids(tiny_processor, record.problem, 1)
    assert expanded_length(len(ids), [(112, 112)], tiny_processor.image_processor) == len(ids) - 1 + 16


@pytest.mark.parametrize(
    "response,truth,expected",
    [
        ("<think>red</think> \\boxed{red}", "red", 1.0),
        ("\\boxed{blue} then \\boxed{Red}", "red", 1.0),  # last box wins, case-insensitive
        ("\\boxed{red} then \\boxed{blue}", "red", 0.0),
        ("no box red", "red", 0.0),
        ("\\boxed{\\text{three}}", "3", 1.0),
        ("\\boxed{3.0}", "3", 1.0),
        ("\\boxed{ left. }", "left", 1.0),
        ("\\boxed{4", "4", 0.0),  # unclosed
        ("\\boxed{grey}", "gray", 1.0),
        ("\\boxed{}", "red", 0.0),
    ],
)
def test_verify(response, truth, expected):
    assert verify(response, truth) == expected


def test_last_boxed_handles_nested_braces():
    assert last_boxed("\\boxed{\\frac{1}{2}} x") == "\\frac{1}{2}"
    assert last_boxed("nothing") is None


def test_equal_area_count_scenes_make_the_count_readable_from_the_covered_area():
    """With equal areas and 5% size jitter (deploy/configs/gpu_learn.toml) the covered fraction of the
    image separates every count from the next; with the default spread it does not."""
    import numpy as np

    from tasks.synthetic import SyntheticConfig, make_example

    def ranges(**knobs):
        config = SyntheticConfig(task="count", max_count=6, image_size=224, **knobs)
        covered: dict[int, list[float]] = {}
        for i in range(240):
            ex = make_example(config, "train", i)
            pixels = np.asarray(ex.image).astype(int)
            mask = np.abs(pixels - pixels[0, 0]).sum(axis=2) > 30
            covered.setdefault(int(ex.answer), []).append(mask.mean())
        return [(min(v), max(v)) for _, v in sorted(covered.items())]

    easy = ranges(size_jitter=0.05, equal_area=True)
    assert len(easy) == 6 and all(hi < lo for (_, hi), (lo, _) in zip(easy, easy[1:]))
    hard = ranges()
    assert any(hi >= lo for (_, hi), (lo, _) in zip(hard, hard[1:]))


def test_one_colour_count_scenes_make_the_count_a_linear_image_feature():
    """With every shape red (n_colours=1, small colour jitter: deploy/configs/gpu_learn.toml) the image's
    mean red-minus-green, a linear function of its pixels, separates every count from the next; with
    four colours it does not. n_colours=1 is refused for the colour question (chance would be 1)."""
    import numpy as np

    from tasks.synthetic import SyntheticConfig, make_example

    def ranges(n_colours):
        config = SyntheticConfig(
            task="count", max_count=6, image_size=224, size_jitter=0.05, equal_area=True,
            n_colours=n_colours, colour_jitter=5,
        )  # fmt: skip
        feature: dict[int, list[float]] = {}
        for i in range(240):
            ex = make_example(config, "train", i)
            pixels = np.asarray(ex.image).astype(float)
            feature.setdefault(int(ex.answer), []).append((pixels[..., 0] - pixels[..., 1]).mean())
        return [(min(v), max(v)) for _, v in sorted(feature.items())]

    one = ranges(1)
    assert len(one) == 6 and all(hi < lo for (_, hi), (lo, _) in zip(one, one[1:]))
    four = ranges(4)
    assert any(hi >= lo for (_, hi), (lo, _) in zip(four, four[1:]))
    with pytest.raises(ValueError, match="n_colours must be in 2..10 for task colour"):
        SyntheticConfig(task="colour", n_colours=1).validate()


def test_code_answer_is_the_drawn_colours_number_in_the_legend():
    from tasks.synthetic import PALETTE, SyntheticConfig, make_example, verify

    config = SyntheticConfig(task="code", n_colours=4)
    for i in range(20):
        colour = make_example(SyntheticConfig(task="colour", n_colours=4), "train", i)
        code = make_example(config, "train", i)
        assert code.images[0].tobytes() == colour.images[0].tobytes()  # the same scene
        assert PALETTE[int(code.answer) - 1][0] == colour.answer
        assert "red 1, green 2, blue 3, yellow 4" in code.question and "purple" not in code.question
        assert verify(f"<think> x </think> \\boxed{{{code.answer}}}", code.answer) == 1.0
    assert {make_example(config, "test", i).answer for i in range(40)} == {"1", "2", "3", "4"}
    with pytest.raises(ValueError, match="n_colours must be in 2..10 for task code"):
        SyntheticConfig(task="code", n_colours=1).validate()


def _shapes(image) -> int:
    """Connected foreground blobs of a scene (its shapes: one per grid cell, so they never touch)."""
    import numpy as np

    pixels = np.asarray(image).astype(int)
    mask = np.abs(pixels - pixels[0, 0]).sum(axis=2) > 60
    h, w = mask.shape
    seen, blobs = np.zeros_like(mask), 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        blobs += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return blobs


def test_two_image_records_ask_which_image_has_more_shapes(tmp_path, tiny_processor):
    from tasks.prompt import IMAGE_PAD, render_prompt_ids
    from tasks.synthetic import images_per_prompt

    config = SyntheticConfig(out=tmp_path, task="more", train=40, test=8)
    assert images_per_prompt("more") == 2 and images_per_prompt("colour") == 1
    assert write_task(config) == {"records": {"train": 40, "test": 8}}
    answers = collections.Counter()
    for index, record in enumerate(read_records(tmp_path, "train")):
        ex = make_example(config, "train", index)
        first, second = (_shapes(image) for image in ex.images)
        assert first != second and ex.answer == ("1" if first > second else "2") == record.ground_truth
        assert record.problem.startswith("<image><image>Which image has more shapes")
        assert len(record.images) == 2 and record.images[0].sha256 != record.images[1].sha256
        ids = render_prompt_ids(tiny_processor, record.problem, 2)
        assert ids.count(tiny_processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)) == 2
        answers[record.ground_truth] += 1
    assert set(answers) == {"1", "2"} and min(answers.values()) >= 10
    assert verify("<think> look </think> \\boxed{2}", "2") == verify("\\boxed{second}", "2") == 1.0
    control = make_example(SyntheticConfig(task="more", shuffle_images=True), "train", 0)
    plain = make_example(SyntheticConfig(task="more"), "train", 0)
    assert control.answer == plain.answer and control.images[0].tobytes() != plain.images[0].tobytes()
    with pytest.raises(ValueError, match="2 images"):
        plain.image  # noqa: B018 - a two-image example has no single image
    from runtime.config import validate

    with pytest.raises(ValueError, match="max_count must be in 2..9 for task more"):
        validate(SyntheticConfig(task="more", max_count=1))  # what `python -m tasks synthetic` runs
