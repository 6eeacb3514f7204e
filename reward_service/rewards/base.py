"""What every reward function returns, and how its parts become one scalar reward.

A reward function is a plain callable `(response_text, ground_truth) -> RewardParts`, living in its
own module under `reward_service/rewards/` (see the registry in `__init__.py`). It must be pure
(same input, same output) and must not print or touch the network: the grader process runs it
under a hard timeout and a memory cap, and caches nothing it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class RewardParts:
    """The graded parts of one response; each is in [0, 1]."""

    accuracy: float
    """1.0 when the final answer is right (verifier-specific), else 0.0."""
    format: float
    """1.0 when the response has the requested think-then-answer shape, else 0.0."""


RewardFunction = Callable[[str, str], RewardParts]
"""`fn(response_text, ground_truth) -> RewardParts`."""


@dataclass(frozen=True)
class Weights:
    """How the parts combine: reward = accuracy * accuracy_part + format * format_part."""

    accuracy: float = 0.9
    format: float = 0.1

    def combine(self, accuracy: float, format: float) -> float:
        return self.accuracy * accuracy + self.format * format
