"""Environments of multi-turn episodes: the interface, the registry, and the built-in crop/zoom tool.

An environment answers the model's turns: `reset` with the prompt record and its images, then `step` with
each model turn's text, returning what the environment shows next (text and images), whether the episode is
done, and an optional reward term. The generator runs one environment per episode (generator/episodes.py),
each call on a thread pool under a time limit (`envs.runner`). Write one: docs/environments.md.

`ENVIRONMENTS` maps a name to the module that defines `make(config) -> Environment` (or to
"module:function", a function of that signature); a prompt names its environment in its record's meta
(`meta["env"]`, written by the task) or through the generator's `env.routes` (data source -> name), as
reward functions are chosen. A name of the form "package.module:function" that is not in the registry
is imported as such: an environment of your own needs no edit here.
"""

from __future__ import annotations

import importlib

from envs.base import Environment, Observation, Step

ENVIRONMENTS: dict[str, str] = {
    "crop": "envs.crop",
}
"""Environment name -> module whose `make(config: envs.config.EnvConfig)` returns a fresh Environment."""


class UnknownEnvironment(KeyError):
    """A prompt or a route names an environment that is not in `ENVIRONMENTS`."""


def make(name: str, config) -> Environment:
    """A fresh environment `name` for one episode (`config`: envs.config.EnvConfig)."""
    target = ENVIRONMENTS.get(name, name if ":" in name else "")
    if not target:
        raise UnknownEnvironment(
            f"unknown environment {name!r}; known: {sorted(ENVIRONMENTS)} (or give package.module:function)"
        )
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function or "make")(config)


__all__ = ["ENVIRONMENTS", "Environment", "Observation", "Step", "UnknownEnvironment", "make"]
