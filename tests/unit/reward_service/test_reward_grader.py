"""The grader process under a hard timeout: pathological answers return, the grader survives.

Every case must come back within a generous bound (timeout + process restart) with a valid
Score-able outcome, and the same SafeGrader must still grade a normal answer correctly afterwards.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from reward_service.pool import SafeGrader

TIMEOUT_S = 1.5
BOUND_S = 30.0
"""Far above timeout + restart; only a hang or a crash of the worker misses it."""
T = "<think>a</think>"
IRRATIONAL = "2\\sqrt{3}"  # a non-integer ground truth sends answers down the sympy path


@pytest.fixture(scope="module")
def grader():
    with SafeGrader(timeout_s=TIMEOUT_S, memory_mb=1024, cache_size=0) as g:
        g.start()
        yield g


def _grade_one(grader, response, ground_truth, reward="math"):
    started = time.monotonic()
    [outcome] = grader.grade([(reward, response, ground_truth)])
    assert time.monotonic() - started < BOUND_S
    return outcome


def _still_works(grader):
    outcome = _grade_one(grader, T + "\\boxed{4\\sqrt{3}}", "4\\sqrt{3}")
    assert (outcome.accuracy, outcome.format, outcome.failed) == (1.0, 1.0, False)


PATHOLOGICAL = {
    "megabyte-think": ("<think>" + "a" * 1_000_000 + "</think>\\boxed{4}", "4"),
    "megabyte-whitespace-near-tags": (" " * 1_000_000 + "x<" + " " * 1_000_000, "4"),
    "megabyte-in-box": (T + "\\boxed{" + "1+" * 500_000 + "1}", "4"),
    "many-close-think": ("<think>" + "</think>" * 200_000 + "no box", "4"),
    "deep-braces": (T + "\\boxed{" + "{" * 100_000 + "1" + "}" * 100_000 + "}", "1"),
    "deep-braces-unclosed": (T + "\\boxed{" + "{" * 200_000, "1"),
    "unicode-junk": (T + "\\boxed{" + "é漢\u200b\U0001f600\x00\x07\u202e" * 50 + "}", IRRATIONAL),
    "lone-surrogates": (T + "\\boxed{\ud800\udfff}", "4"),
    "power-tower-braced": (T + "\\boxed{9^{9^{9^9}}}", IRRATIONAL),
    "power-tower-python": (T + "\\boxed{10**10**10}", IRRATIONAL),
    "power-tower-9": (T + "\\boxed{9**9**9}", IRRATIONAL),
    "factorial": (T + "\\boxed{100000!}", IRRATIONAL),
    "huge-factorial": (T + "\\boxed{(10**8)!}", IRRATIONAL),
    "nested-fracs": (T + "\\boxed{" + "\\frac{1}{" * 3000 + "2" + "}" * 3000 + "}", IRRATIONAL),
    "nested-sqrt": (T + "\\boxed{" + "\\sqrt{" * 400 + "3" + "}" * 400 + "}", IRRATIONAL),
    "left-right-bomb": (T + "\\boxed{" + "\\left(" * 5000 + "1" + "\\right)" * 5000 + "}", IRRATIONAL),
    "environment-bomb": (T + "\\boxed{" + "\\begin{matrix}" * 2000 + "1" + "\\end{matrix}" * 2000 + "}", "1"),
    "symbolic-power": (T + "\\boxed{(x+1)**500 - x}", "x"),
}


@pytest.mark.parametrize("name", list(PATHOLOGICAL))
def test_pathological_answer_returns_and_grader_survives(grader, name):
    response, ground_truth = PATHOLOGICAL[name]
    outcome = _grade_one(grader, response, ground_truth)
    assert outcome.accuracy in (0.0, 1.0) and outcome.format in (0.0, 1.0)
    if outcome.failed:
        assert outcome.accuracy == 0.0
    _still_works(grader)


def test_a_timeout_is_flagged_counted_and_recovered(grader):
    before_timeouts, before_restarts = grader.timeouts, grader.restarts
    good = (T + "\\boxed{7.5}", "\\frac{15}{2}")
    items = [("math", *good), ("math", T + "\\boxed{9**9**9}", IRRATIONAL), ("math", *good)]
    outcomes = grader.grade(items)
    assert [o.timed_out for o in outcomes] == [False, True, False]
    assert [o.accuracy for o in outcomes] == [1.0, 0.0, 1.0]
    assert grader.timeouts == before_timeouts + 1
    assert grader.restarts == before_restarts + 1


def test_a_killed_grader_is_a_crash_then_replaced(grader):
    grader.grade([("math", T + "\\boxed{1}", "1")])
    os.kill(grader._active.proc.pid, signal.SIGKILL)
    [outcome] = grader.grade([("math", T + "\\boxed{2}", "2")])
    # The kill lands between batches: the send or the read fails and the item is retried or flagged.
    assert outcome.crashed or outcome.accuracy == 1.0
    _still_works(grader)


def test_a_raising_reward_is_an_error_not_a_crash(grader):
    [outcome] = grader.grade([("no-such-reward", "x", "y")])
    assert "UnknownReward" in outcome.error and not outcome.failed
    _still_works(grader)


def test_identical_items_are_graded_once():
    with SafeGrader(timeout_s=TIMEOUT_S, cache_size=16, spare=False) as g:
        item = ("math", T + "\\boxed{9**9**9}", IRRATIONAL)
        outcomes = g.grade([item, item, item])
        assert [o.timed_out for o in outcomes] == [True, True, True]
        assert [o.cached for o in outcomes] == [False, True, True]
        assert g.timeouts == 1
        [again] = g.grade([item])
        assert again.timed_out and again.cached and g.timeouts == 1


def test_a_batch_budget_bounds_many_different_hanging_answers(grader):
    hanging = [("math", T + f"\\boxed{{{n}**{n}**{n}}}", IRRATIONAL) for n in (9, 11, 12, 13, 14, 15)]
    good = ("math", T + "\\boxed{4}", "4")
    started = time.monotonic()
    outcomes = grader.grade([good, *hanging], budget_s=2 * TIMEOUT_S)
    assert time.monotonic() - started < BOUND_S
    assert outcomes[0].accuracy == 1.0
    assert all(o.timed_out and o.accuracy == 0.0 for o in outcomes[1:])
    _still_works(grader)


def test_a_spare_that_died_idle_is_replaced():
    with SafeGrader(timeout_s=TIMEOUT_S, spare=True) as g:
        g.start()
        os.kill(g._spare.proc.pid, signal.SIGKILL)
        [outcome] = g.grade([("math", T + "\\boxed{9**9**9}", IRRATIONAL)])  # swaps the dead spare in
        assert outcome.timed_out
        _still_works(g)


def test_batches_in_flight_survive_a_timeout_and_keep_their_own_budget(grader):
    hanging = ("math", T + "\\boxed{9**9**9}", IRRATIONAL)
    good = [("math", T + f"\\boxed{{{n}}}", str(n)) for n in range(3)]
    first = grader.submit([good[0], hanging], budget_s=TIMEOUT_S)
    second = grader.submit(good[1:], budget_s=TIMEOUT_S)  # queued behind the hang, then resent
    started = time.monotonic()
    late = grader.finish(second)  # reads the first batch's answers on the way
    assert time.monotonic() - started < BOUND_S
    assert [(o.accuracy, o.failed) for o in late] == [(1.0, False), (1.0, False)]  # budget not spent
    early = grader.finish(first)
    assert early[0].accuracy == 1.0 and early[1].timed_out


def test_a_batch_bigger_than_the_pipe_never_blocks_the_sender(grader):
    hanging = ("math", T + "\\boxed{9**9**9}", IRRATIONAL)
    busy = grader.submit([hanging])
    started = time.monotonic()
    big = grader.submit([("math", "<think>" + "a" * 2_000_000 + "</think>\\boxed{4}", "4")])
    assert time.monotonic() - started < 0.5 * TIMEOUT_S  # queued, not written through a full pipe
    assert grader.finish(busy)[0].timed_out
    [outcome] = grader.finish(big)
    assert (outcome.accuracy, outcome.failed) == (1.0, False)
    _still_works(grader)
