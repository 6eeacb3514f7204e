"""The reward benchmark's workloads (bench/reward.py): Geometry3k-style groups, the slow tail, and EasyR1's
reward code, which the benchmark runs as the reference.

    from bench.reward_workloads import typical_groups, pathological_items, easyr1_score
"""

from __future__ import annotations

import random
import re

GROUP = 8
FILLER = (
    "Let the angle be x. Since the triangle is isosceles, the base angles are equal. "
    "By the Pythagorean theorem, a^2 + b^2 = c^2. The area is half the base times the height. "
)


def _truth(rng: random.Random) -> tuple[str, list[str], list[str]]:
    """A ground truth, equivalent renderings of it, and wrong answers of the same shape."""
    kind = rng.choices(["int", "angle", "decimal", "sqrt", "frac"], [45, 15, 10, 20, 10])[0]
    n = rng.randint(2, 120)
    if kind == "int":
        return str(n), [f"{n}.0", f"{n} \\text{{ cm}}"], [str(n + d) for d in (1, -1, 2, 10)]
    if kind == "angle":
        return str(n), [f"{n}^\\circ", f"{n}^{{\\circ}}"], [f"{n + d}^\\circ" for d in (5, -5, 30)]
    if kind == "decimal":
        return f"{n}.5", [f"\\frac{{{2 * n + 1}}}{{2}}"], [f"{n}.25", f"{n + 1}.5"]
    if kind == "sqrt":
        a, b = rng.randint(2, 9), rng.choice([2, 3, 5, 6, 7])
        return (
            f"{a}\\sqrt{{{b}}}",
            [f"{a} \\sqrt {b}", f"\\sqrt{{{a * a * b}}}"],
            [f"{a + 1}\\sqrt{{{b}}}", f"{a * a * b}", f"{round(a * b**0.5, 2)}"],
        )
    p, q = rng.choice([(1, 2), (3, 4), (5, 3), (7, 2), (15, 4)])
    return f"\\frac{{{p}}}{{{q}}}", [f"{p}/{q}", f"{p / q:g}"], [f"\\frac{{{q}}}{{{p}}}", f"{p + 1}/{q}"]


def typical_groups(count: int, seed: int) -> list[tuple[str, list[str]]]:
    """(ground truth, 8 responses) per group, Geometry3k-like."""
    rng = random.Random(seed)
    groups = []
    for g in range(count):
        truth, same, wrong = _truth(rng)
        responses = []
        for s in range(GROUP):
            think = f"<think>Step {g}.{s}: " + FILLER * rng.randint(1, 4) + "</think>"
            roll = rng.random()
            if roll < 0.40:
                answer = f"\\boxed{{{truth}}}"
            elif roll < 0.55:
                answer = f"\\boxed{{{rng.choice(same)}}}"
            elif roll < 0.92:
                answer = f"\\boxed{{{rng.choice(wrong)}}}"
            else:
                answer = f"so the answer is {truth}."
            responses.append(f"{think} The answer is {answer}")
        groups.append((truth, responses))
    return groups


def pathological_items() -> list[tuple[str, str, str]]:
    """(name, response, ground truth) of the slow tail."""
    t, irr = "<think>a</think>", "2\\sqrt{3}"
    return [
        ("megabyte-think", "<think>" + "a" * 1_000_000 + "</think>\\boxed{4}", "4"),
        ("megabyte-whitespace", " " * 1_000_000 + "x<" + " " * 1_000_000, "4"),
        ("megabyte-in-box", t + "\\boxed{" + "1+" * 500_000 + "1}", "4"),
        ("deep-braces", t + "\\boxed{" + "{" * 100_000 + "1" + "}" * 100_000 + "}", "1"),
        ("unicode-junk", t + "\\boxed{" + "é漢\u200b\U0001f600\x07\u202e" * 50 + "}", irr),
        ("nested-fracs", t + "\\boxed{" + "\\frac{1}{" * 3000 + "2" + "}" * 3000 + "}", irr),
        ("left-right-bomb", t + "\\boxed{" + "\\left(" * 5000 + "1" + "\\right)" * 5000 + "}", irr),
        ("power-tower-braced", t + "\\boxed{9^{9^{9^9}}}", irr),
        ("power-tower-9", t + "\\boxed{9**9**9}", irr),
        ("power-tower-10", t + "\\boxed{10**10**10}", irr),
        ("factorial-1e5", t + "\\boxed{100000!}", irr),
        ("factorial-1e8", t + "\\boxed{(10**8)!}", irr),
    ]


def easyr1_score(response: str, truth: str) -> tuple[float, float]:
    """The reference: EasyR1's math reward, mathruler called in this process."""
    from mathruler.grader import extract_boxed_content, grade_answer

    response = re.sub(r"\s*(<|>|/)\s*", r"\1", response)
    fmt = 1.0 if re.fullmatch(r"<think>.*</think>.*\\boxed\{.*\}.*", response, re.DOTALL) else 0.0
    return (1.0 if grade_answer(extract_boxed_content(response), truth) else 0.0), fmt
