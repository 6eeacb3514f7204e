"""Environment calls on the runner's pool: a stuck or raising call fails alone, with its reason; calls
waiting behind a stuck one still run."""

from __future__ import annotations

import threading

from envs.runner import EnvFailure, EnvRunner


def test_results_come_back_in_order_and_failures_carry_their_reason():
    release = threading.Event()
    runner = EnvRunner(threads=1, timeout_s=0.2)

    def stuck():
        release.wait(30)
        return "late"

    def boom():
        raise RuntimeError("the environment crashed")

    try:
        outcomes = runner.run([lambda: 1, stuck, lambda: 3, boom, lambda: 5])
    finally:
        release.set()
        runner.close()
    assert outcomes[0] == 1 and outcomes[2] == 3 and outcomes[4] == 5  # behind the stuck call, on one thread
    assert isinstance(outcomes[1], EnvFailure) and outcomes[1].reason == "timeout"
    assert isinstance(outcomes[3], EnvFailure) and outcomes[3].reason == "error"
    assert "RuntimeError: the environment crashed" in str(outcomes[3])
    assert runner.abandoned == 1
