"""Reward of the procedurally generated visual task: its own verifier + the think-then-boxed format.

accuracy = `tasks.synthetic.verify(response_text, ground_truth)`: the task owns what counts as a
right answer (the last `\\boxed{}` equals the ground truth after its normalisation: case, `\\text{}`,
number words). format = the math reward's think-then-boxed check, after the same tag normalisation.
"""

from __future__ import annotations

from reward_service.rewards.base import RewardParts
from reward_service.rewards.math import format_score
from tasks.synthetic import verify

__all__ = ["compute", "format_score"]


def compute(response: str, ground_truth: str) -> RewardParts:
    """The synthetic task's reward parts for one response."""
    accuracy = 1.0 if verify(response, ground_truth) else 0.0
    return RewardParts(accuracy=accuracy, format=format_score(response))
