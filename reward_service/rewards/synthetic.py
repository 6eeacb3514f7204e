"""Reward of the procedurally generated visual task: its own verifier + the think-then-boxed format.

accuracy = `tasks.synthetic.verify(response_text, ground_truth)` (the task owns what counts as a right
answer); format = the math reward's think-then-boxed check, after the same tag normalisation.
Until tasks/synthetic.py provides `verify`, `local_verify` below applies the same rule: the last
`\\boxed{}`'s content equals the ground truth after normalisation (case, whitespace, `\\text{}`, `$`).
"""

from __future__ import annotations

import re

from mathruler.grader import extract_boxed_content

from reward_service.rewards.base import RewardParts
from reward_service.rewards.math import format_score

_TEXT_WRAPPER = re.compile(r"^\\(?:text|mathrm|textbf)\{(.*)\}$", re.DOTALL)


def normalize_answer(text: str) -> str:
    """Lower-case, unwrap `\\text{..}`/`$..$`, collapse whitespace, drop a trailing period."""
    text = text.strip().strip("$").strip()
    while (m := _TEXT_WRAPPER.match(text)) is not None:
        text = m.group(1).strip()
    text = " ".join(text.split()).lower()
    return text.rstrip(".").strip()


def local_verify(response_text: str, ground_truth: str) -> bool:
    """The last boxed answer equals `ground_truth` after `normalize_answer` on both."""
    answer = extract_boxed_content(response_text)
    if answer == "None" and "\\boxed{" not in response_text:
        return False
    return normalize_answer(answer) == normalize_answer(ground_truth)


def _verifier():
    try:
        from tasks.synthetic import verify
    except ImportError:
        return local_verify
    return verify


__all__ = ["compute", "format_score", "local_verify"]


def compute(response: str, ground_truth: str) -> RewardParts:
    """The synthetic task's reward parts for one response."""
    verify = _verifier()
    accuracy = 1.0 if verify(response, ground_truth) else 0.0
    return RewardParts(accuracy=accuracy, format=format_score(response))
