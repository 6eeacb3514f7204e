"""Scripted environments for the episode tests, named by path ("tests.support.scripted_env:always_crop"):

always_crop   answers every turn with a crop of the prompt's first image (a fixed box per turn), whatever
              the model wrote, so an untrained model's episodes still have tool turns with images
stuck         never answers its first step (until `RELEASE` is set): its episode times out
crash         raises in reset
"""

from __future__ import annotations

import threading

from envs.base import Environment, Observation, Step

RELEASE = threading.Event()
BOXES = ((0, 0, 40, 40), (20, 10, 60, 50), (5, 5, 25, 45))


class AlwaysCrop(Environment):
    def reset(self, record, images):
        self.image, self.turn = images[0], 0

    def step(self, turn):
        box = BOXES[self.turn % len(BOXES)]
        self.turn += 1
        crop = self.image.crop(box).resize((56 + 28 * (self.turn % 2), 56))
        text = "" if self.turn % 2 else "a text-only answer first"
        images = [] if self.turn == 2 else [crop]
        return Step(Observation(text=text, images=images), tool_calls=1, reward=0.5)


class Stuck(Environment):
    def reset(self, record, images):
        pass

    def step(self, turn):
        RELEASE.wait(60)
        return Step(done=True)


class Crash(Environment):
    def reset(self, record, images):
        raise RuntimeError("this environment cannot start")

    def step(self, turn):
        return Step(done=True)


def always_crop(config) -> AlwaysCrop:
    return AlwaysCrop()


def stuck(config) -> Stuck:
    return Stuck()


def crash(config) -> Crash:
    return Crash()
