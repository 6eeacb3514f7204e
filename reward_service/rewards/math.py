"""Math reward (Geometry3k and the default): mathruler accuracy on the last \\boxed{} + format.

Reproduces EasyR1's `examples/reward_function/math.py` (which veRL's geo3k reward matches apart
from the whitespace step):

  * the response (decoded response tokens only, never prompt + response) is first normalised:
    whitespace around `<`, `>` and `/` is removed (`re.sub(r"\\s*(<|>|/)\\s*", r"\\1", ...)`);
  * accuracy = mathruler `grade_answer(extract_boxed_content(response), ground_truth)`, where
    `extract_boxed_content` takes the LAST `\\boxed{...}` (and returns the string "None" if none);
  * format = the whole response matches `<think>.*</think>.*\\boxed\\{.*\\}.*` (DOTALL).

The two regular-expression steps are re-implemented in linear time (EasyR1's forms backtrack
quadratically on long whitespace runs and on many `</think>`s); tests check both forms agree.
Answers longer than `MAX_ANSWER_CHARS` are scored 0 without calling sympy: no Geometry3k answer is
anywhere near that long, and the parser's cost grows with length. The hard timeout around the
grader process (reward_service/grader.py) is still the guarantee that nothing hangs.
"""

from __future__ import annotations

import re

from mathruler.grader import extract_boxed_content, grade_answer

from reward_service.rewards.base import RewardParts

MAX_ANSWER_CHARS = 512
"""Boxed answers longer than this are wrong by fiat (sympy is never asked about them)."""

_WHITESPACE_RUN = re.compile(r"\s+")
_TAG_CHARS = "<>/"


def normalize_tags(response: str) -> str:
    """Drop every whitespace run that touches `<`, `>` or `/` (EasyR1's qwen2.5-vl fix-up)."""

    def keep_or_drop(m: re.Match) -> str:
        start, end = m.span()
        touches = (start > 0 and response[start - 1] in _TAG_CHARS) or (
            end < len(response) and response[end] in _TAG_CHARS
        )
        return "" if touches else m.group()

    return _WHITESPACE_RUN.sub(keep_or_drop, response)


def format_reward(response: str) -> float:
    """1.0 iff `response` (already normalised) fullmatches `<think>.*</think>.*\\boxed\\{.*\\}.*`."""
    if not response.startswith("<think>"):
        return 0.0
    close = response.find("</think>", len("<think>"))
    if close < 0:
        return 0.0
    box = response.find("\\boxed{", close + len("</think>"))
    if box < 0:
        return 0.0
    return 1.0 if response.find("}", box + len("\\boxed{")) >= 0 else 0.0


def accuracy_reward(response: str, ground_truth: str) -> float:
    """1.0 iff mathruler grades the last boxed answer of `response` equal to `ground_truth`."""
    answer = extract_boxed_content(response)
    if len(answer) > MAX_ANSWER_CHARS:
        return 0.0
    return 1.0 if grade_answer(answer, ground_truth) else 0.0


def format_score(response: str) -> float:
    """The format part alone (linear time; used when grading timed out or failed)."""
    return format_reward(normalize_tags(response))


def compute(response: str, ground_truth: str) -> RewardParts:
    """The math reward's parts for one response."""
    response = normalize_tags(response)
    return RewardParts(accuracy=accuracy_reward(response, ground_truth), format=format_reward(response))
