"""Registry of reward functions: one module per reward, chosen per data source.

`REWARDS` maps a reward name to the module whose `compute(response, ground_truth)` returns
`RewardParts` and whose `format_score(response)` returns the format part alone (in linear time: the
worker calls it in-process when grading timed out); `route(data_source, routes)` picks the reward name for a
rollout group's data source
(unlisted sources get the default, "math"). Add a reward by adding a module and a line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from reward_service.rewards.base import RewardFunction, RewardParts, Weights

REWARDS: dict[str, str] = {
    "math": "reward_service.rewards.math",
    "synthetic": "reward_service.rewards.synthetic",
}
"""Reward name -> module that defines `compute`."""

DEFAULT_ROUTES: dict[str, str] = {
    "geometry3k": "math",
    "hiyouga/geometry3k": "math",
    "synthetic": "synthetic",
    "zoom": "synthetic",
}
"""Data source -> reward name, before any configured overrides."""

DEFAULT_REWARD = "math"


class UnknownReward(KeyError):
    """A route names a reward that is not in `REWARDS`."""


def route(data_source: str, routes: dict[str, str] | None = None, default: str = DEFAULT_REWARD) -> str:
    """The reward name for `data_source`: configured routes, then `DEFAULT_ROUTES`, then `default`."""
    name = {**DEFAULT_ROUTES, **(routes or {})}.get(data_source, default)
    if name not in REWARDS:
        raise UnknownReward(f"data source {data_source!r} routes to unknown reward {name!r}")
    return name


def load(name: str) -> RewardFunction:
    """Import the reward module `name` and return its `compute` function."""
    if name not in REWARDS:
        raise UnknownReward(f"unknown reward {name!r}; known: {sorted(REWARDS)}")
    return importlib.import_module(REWARDS[name]).compute


def load_format(name: str) -> Callable[[str], float]:
    """The `format_score` function of reward module `name`."""
    if name not in REWARDS:
        raise UnknownReward(f"unknown reward {name!r}; known: {sorted(REWARDS)}")
    return importlib.import_module(REWARDS[name]).format_score


__all__ = [
    "REWARDS",
    "DEFAULT_ROUTES",
    "RewardFunction",
    "RewardParts",
    "Weights",
    "load",
    "load_format",
    "route",
]
