"""Group-relative advantage estimators and DAPO's dynamic sampling filter.

Every estimator maps the rewards of one group (n samples of one prompt) to one scalar
advantage per sample; the learner broadcasts it over that sample's response tokens.

  * ``grpo``   : (r - mean) / (std + eps), std unbiased as in veRL/EasyR1 (`torch.std`).
  * ``drgrpo`` : r - mean (Dr.GRPO: no std division; its length normalisation lives in the loss).
  * ``rloo``   : r_i - mean_{j != i} r_j (leave-one-out baseline) = n/(n-1) (r_i - mean).

A group of one sample has no baseline: its advantage is 0 under every estimator.
`filter_zero_variance` is DAPO's dynamic sampling: groups whose rewards are all equal carry
no signal under any of these estimators, so they are dropped (and counted) before training.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, get_args

import torch

from learner.config import Estimator

T = TypeVar("T")


def group_advantages(
    rewards: Sequence[float], estimator: Estimator = "grpo", eps: float = 1e-6
) -> list[float]:
    """Advantages of the samples of one group, in order."""
    if estimator not in get_args(Estimator):
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {get_args(Estimator)}")
    r = torch.as_tensor(list(rewards), dtype=torch.float64)
    n = r.numel()
    if n == 0:
        return []
    if n == 1 or bool((r == r[0]).all()):
        return [0.0] * n
    mean = r.mean()
    if estimator == "grpo":
        adv = (r - mean) / (r.std(unbiased=True) + eps)
    elif estimator == "drgrpo":
        adv = r - mean
    else:  # rloo
        adv = (r - mean) * (n / (n - 1))
    return adv.tolist()


def batch_advantages(
    groups_rewards: Sequence[Sequence[float]], estimator: Estimator = "grpo", eps: float = 1e-6
) -> list[list[float]]:
    """`group_advantages` for each group of a batch."""
    return [group_advantages(rewards, estimator, eps) for rewards in groups_rewards]


def has_variance(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """True when the rewards of a group are not all equal (within `tol`)."""
    return len(rewards) > 1 and (max(rewards) - min(rewards)) > tol


def filter_zero_variance(groups: Sequence[T], rewards_of, tol: float = 1e-9) -> tuple[list[T], int]:
    """DAPO dynamic sampling: keep the groups whose rewards vary; return (kept, dropped count).

    `rewards_of(group)` returns that group's per-sample rewards.
    """
    kept = [g for g in groups if has_variance(list(rewards_of(g)), tol)]
    return kept, len(groups) - len(kept)
