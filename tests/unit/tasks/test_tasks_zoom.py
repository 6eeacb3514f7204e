"""The zoom task: the colour is lost at the processor's resolution and plain in a crop around the hint;
records name the crop environment (not in the control); examples are reproducible."""

from __future__ import annotations

import json

import numpy as np

from envs.config import CropConfig
from envs.crop import CropEnv
from reward_service.rewards import route
from tasks.synthetic import PALETTE
from tasks.zoom import ZoomConfig, make_example, write_task


def _nearest(pixels: np.ndarray, rgb) -> float:
    return float(np.linalg.norm(pixels.reshape(-1, 3).astype(float) - np.array(rgb), axis=-1).min())


def test_the_colour_is_lost_at_the_processors_resolution_and_plain_in_a_crop():
    config = ZoomConfig()
    for index in range(4):
        image, name, (x, y) = make_example(config, "test", index)
        rgb = dict(PALETTE)[name]
        shrunk = np.asarray(image.resize((224, 224), 3))  # the small preset's max_pixels: 224 x 224
        near = shrunk[max(0, y // 4 - 10) : y // 4 + 10, max(0, x // 4 - 10) : x // 4 + 10]
        assert _nearest(near, rgb) > 60  # a pale smear: no pixel near the colour
        env = CropEnv(CropConfig(max_pixels=224 * 224))
        env.reset(None, [image])
        x, y = min(max(x, 32), 896 - 32), min(max(y, 32), 896 - 32)  # a 64-pixel box inside the image
        box = [x - 32, y - 32, x + 32, y + 32]
        step = env.step(
            json.dumps({"name": "crop", "arguments": {"bbox": box}}).join(["<tool_call>", "</tool_call>"])
        )
        (crop,) = step.observation.images
        assert crop.size == (224, 224) and _nearest(np.asarray(crop), rgb) < 30
    again = make_example(config, "test", 2)
    assert (
        again[1:] == make_example(config, "test", 2)[1:]
        and again[0].tobytes() == make_example(config, "test", 2)[0].tobytes()
    )


def test_records_name_the_environment_and_the_control_does_not(tmp_path):
    from tasks.records import read_records

    write_task(ZoomConfig(out=tmp_path / "tool", train=3, test=2))
    write_task(ZoomConfig(out=tmp_path / "control", train=3, test=2, tool_free=True))
    tool = [r for split in ("train", "test") for r in read_records(tmp_path / "tool", split)]
    control = [r for split in ("train", "test") for r in read_records(tmp_path / "control", split)]
    assert len(tool) == len(control) == 5
    assert all(
        r.meta["env"] == "crop" and "<tool_call>" in r.problem and r.data_source == "zoom" for r in tool
    )
    assert all("env" not in r.meta and "<tool_call>" not in r.problem for r in control)
    assert [r.images for r in tool] == [r.images for r in control] and route("zoom") == "synthetic"
