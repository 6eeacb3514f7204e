"""Reference table of the Geometry3k math reward: (response, ground truth, accuracy, format).

Expected values are those of EasyR1's `examples/reward_function/math.py` (veRL's geo3k reward is the
same without the tag-whitespace step), i.e. mathruler's `grade_answer` on the LAST \\boxed{} and the
think-then-boxed fullmatch on the response alone. Each row is also checked against a direct
re-statement of EasyR1's regular-expression code (`easyr1_reference`), so a row whose expectation
was written down wrong fails too.
"""

from __future__ import annotations

import random
import re

import pytest
from mathruler.grader import extract_boxed_content, grade_answer

from reward_service.rewards import Weights
from reward_service.rewards.math import compute, format_reward, normalize_tags

T = "<think>a</think>"

TABLE = [
    # (id, response, ground truth, accuracy, format)
    ("plain", "<think>2+2=4</think> The answer is \\boxed{4}", "4", 1, 1),
    ("last-box-wins", T + " \\boxed{3} no wait \\boxed{4}", "4", 1, 1),
    ("last-box-wins-not-first", T + " \\boxed{3} no wait \\boxed{4}", "3", 0, 1),
    ("unclosed-last-box-hides-earlier", T + "\\boxed{4} \\boxed{5", "4", 0, 1),
    ("nested-box", T + "\\boxed{\\boxed{4}}", "4", 1, 1),
    ("no-box", "<think>x</think> The answer is 4", "4", 0, 0),
    ("unclosed-box", T + " \\boxed{4", "4", 0, 0),
    ("empty-box", T + "\\boxed{}", "4", 0, 1),
    ("fbox-is-not-boxed", T + "\\fbox{4}", "4", 0, 0),
    ("no-box-vs-literal-None", T + " no box at all", "None", 1, 0),  # mathruler quirk, kept
    ("wrong-number", T + "\\boxed{25}", "26", 0, 1),
    ("sign-matters", T + "\\boxed{3}", "-3", 0, 1),
    ("negative", T + "\\boxed{- 3}", "-3", 1, 1),
    ("unreduced-fraction-slash", T + "\\boxed{2/4}", "\\frac{1}{2}", 0, 1),
    ("unreduced-fraction-frac", T + "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 0, 1),
    ("unreduced-fraction-34/4", T + "\\boxed{34/4}", "\\frac{17}{2}", 0, 1),
    ("reduced-fraction", T + "\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1, 1),
    ("dfrac", T + "\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1, 1),
    ("slash-fraction", T + "\\boxed{17/2}", "\\frac{17}{2}", 1, 1),
    ("slash-with-spaces", T + "\\boxed{1 / 2}", "\\frac{1}{2}", 1, 1),
    ("decimal-vs-fraction", T + "\\boxed{0.5}", "\\frac{1}{2}", 1, 1),
    ("decimal-vs-fraction-2", T + "\\boxed{7.5}", "\\frac{15}{2}", 1, 1),
    ("rounded-decimal-is-wrong", T + "\\boxed{0.3333}", "\\frac{1}{3}", 0, 1),
    ("mixed-number", T + "\\boxed{3\\frac{1}{2}}", "3.5", 1, 1),
    ("trailing-zero", T + "\\boxed{12.50}", "12.5", 1, 1),
    ("integer-as-float", T + "\\boxed{42.0}", "42", 1, 1),
    ("unit-text-cm", T + "\\boxed{5 \\text{ cm}}", "5", 1, 1),
    ("unit-bare-cm", T + "\\boxed{12 cm}", "12", 1, 1),
    ("unit-text-nospace", T + "\\boxed{12\\text{cm}}", "12", 1, 1),
    ("unit-text-units", T + "\\boxed{12 \\text{ units}}", "12", 1, 1),
    ("degrees-circ", T + "\\boxed{30^\\circ}", "30", 1, 1),
    ("degrees-braced-circ", T + "\\boxed{30^{\\circ}}", "30", 1, 1),
    ("degrees-word", T + "\\boxed{30 degrees}", "30", 1, 1),
    ("degree-sign-not-understood", T + "\\boxed{30°}", "30", 0, 1),
    ("ground-truth-in-degrees", T + "\\boxed{60}", "60^\\circ", 1, 1),
    ("thousands-separator", T + "\\boxed{1,000}", "1000", 1, 1),
    ("thousands-separators", T + "\\boxed{1,000,000}", "1000000", 1, 1),
    ("percent", T + "\\boxed{50\\%}", "50", 1, 1),
    ("dollar", T + "\\boxed{\\$5}", "5", 1, 1),
    ("inline-math", T + "$\\boxed{4}$.", "4", 1, 1),
    ("x-equals", T + "\\boxed{x=5}", "5", 1, 1),
    ("sqrt", T + "\\boxed{4\\sqrt{3}}", "4\\sqrt{3}", 1, 1),
    ("sqrt-unbraced", T + "\\boxed{4 \\sqrt 3}", "4\\sqrt{3}", 1, 1),
    ("sqrt-python", T + "\\boxed{4*sqrt(3)}", "4\\sqrt{3}", 1, 1),
    ("sqrt-simplified-by-sympy", T + "\\boxed{\\sqrt{52}}", "2\\sqrt{13}", 1, 1),
    ("sqrt-decimal-is-wrong", T + "\\boxed{6.93}", "4\\sqrt{3}", 0, 1),
    ("spaces-in-ground-truth", T + "\\boxed{2\\sqrt{13}}", "2 \\sqrt { 13 }", 1, 1),
    ("nested-braces", T + "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1, 1),
    ("pi", T + "\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1, 1),
    ("fraction-vs-decimal-gt", T + "\\boxed{\\frac{25}{2}}", "12.5", 1, 1),
    ("choice-letter", T + "\\boxed{\\text{A}}", "A", 1, 1),
    ("choice-letter-wrong", T + "\\boxed{B}", "A", 0, 1),
    ("tuple", T + "\\boxed{(2, 3)}", "(2,3)", 1, 1),
    ("tuple-order", T + "\\boxed{(3, 2)}", "(2,3)", 0, 1),
    # format
    ("box-without-think", "\\boxed{4}", "4", 1, 0),
    ("prompt-tags-not-counted", "The answer is \\boxed{4}", "4", 1, 0),
    ("empty-think", "<think></think>\\boxed{4}", "4", 1, 1),
    ("whitespace-in-tags", "< think >reasoning</ think > \\boxed{4}", "4", 1, 1),
    ("newlines", "<think>\nreasoning\n</think >\n\n\\boxed{4}\n", "4", 1, 1),
    ("think-after-box", "\\boxed{4}<think>a</think>", "4", 1, 0),
    ("text-before-think", "Sure. <think>a</think>\\boxed{4}", "4", 1, 0),
    ("unclosed-think", "<think>a \\boxed{4}", "4", 1, 0),
    ("box-only-inside-think", "<think>\\boxed{3}</think> so 4", "3", 1, 0),
    ("uppercase-tags", "<THINK>a</THINK>\\boxed{4}", "4", 1, 0),
]


def easyr1_reference(response: str, ground_truth: str) -> tuple[float, float]:
    """EasyR1's math reward, restated with its own regular expressions (the oracle)."""
    response = re.sub(r"\s*(<|>|/)\s*", r"\1", response)
    pattern = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
    fmt = 1.0 if re.fullmatch(pattern, response) else 0.0
    acc = 1.0 if grade_answer(extract_boxed_content(response), ground_truth) else 0.0
    return acc, fmt


@pytest.mark.parametrize(
    "response, ground_truth, accuracy, format", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE]
)
def test_reference_row(response, ground_truth, accuracy, format):
    parts = compute(response, ground_truth)
    assert (parts.accuracy, parts.format) == (accuracy, format)
    assert easyr1_reference(response, ground_truth) == (accuracy, format)


def test_prompt_plus_response_would_fake_the_format():
    """Why only the response is scored: the prompt's own instruction text contains the tags."""
    prompt = "Think inside <think> </think> and put the answer in \\boxed{}."
    response = "The answer is \\boxed{4}"
    assert compute(response, "4").format == 0.0
    assert format_reward(normalize_tags("<think>" + prompt + "</think>" + response)) == 1.0


def test_weights_combine_to_the_reward():
    assert Weights().combine(1.0, 1.0) == pytest.approx(1.0)
    assert Weights().combine(0.0, 1.0) == pytest.approx(0.1)
    assert Weights().combine(1.0, 0.0) == pytest.approx(0.9)
    assert Weights(accuracy=1.0, format=0.5).combine(1.0, 1.0) == pytest.approx(1.5)


PIECES = [
    "<",
    ">",
    "/",
    " ",
    "\n",
    "\t",
    "<think>",
    "</think>",
    "< think >",
    "</ think>",
    "\\boxed{",
    "}",
    "{",
    "a",
    "4",
    "\u3000",
    "\\",
    "think",
]


def test_linear_time_forms_equal_easyr1_regexes_on_random_strings():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 14)))
        normalized = re.sub(r"\s*(<|>|/)\s*", r"\1", text)
        assert normalize_tags(text) == normalized, repr(text)
        expected = 1.0 if re.fullmatch(r"<think>.*</think>.*\\boxed\{.*\}.*", normalized, re.DOTALL) else 0.0
        assert format_reward(normalized) == expected, repr(normalized)
