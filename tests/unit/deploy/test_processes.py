"""Supervision: crashed children are restarted (bounded, counted, backed off), finished ones are not;
--resume argument handling."""

import sys
import time

import pytest

from deploy.failures import classify
from deploy.processes import ChildDied, ProcessGroup
from deploy.resume import resumed_config, split_resume


def _wait_exit(child, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while child.popen.poll() is None:
        assert time.monotonic() < deadline, "child did not exit"
        time.sleep(0.02)


def test_a_crashing_child_is_restarted_a_bounded_number_of_times(tmp_path):
    restarted = []
    group = ProcessGroup(tmp_path, on_restart=lambda child, code: restarted.append((child.restarts, code)))
    crash = [sys.executable, "-c", "print('alive'); raise SystemExit(3)"]
    child = group.start("crashy", crash, restarts=2)
    _wait_exit(child)
    group.check()  # the first restart is immediate
    assert restarted == [(1, 3)] and child.restarts == 1
    _wait_exit(child)
    started = time.monotonic()
    while len(restarted) < 2:  # the second waits 1 s
        group.check()
        time.sleep(0.05)
    assert time.monotonic() - started >= 0.9 and restarted[-1] == (2, 3)
    _wait_exit(child)
    with pytest.raises(ChildDied, match="after 2 restarts"):
        group.check()
    log = child.log_path.read_text()
    assert log.count("alive") == 3 and "restart 2/2" in log
    group.stop()


def test_a_child_that_finishes_is_not_restarted_and_a_stopped_group_restarts_nothing(tmp_path):
    group = ProcessGroup(tmp_path)
    done = group.start("done", [sys.executable, "-c", "pass"], critical=False, restarts=3)
    sleeper = group.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"], restarts=3)
    _wait_exit(done)
    group.check()
    assert done.restarts == 0 and done.popen.returncode == 0
    group.stop(grace_s=2)
    assert sleeper.popen.poll() is not None
    with pytest.raises(ChildDied):  # killed while stopping: no restart left, it is reported
        group.check()
    assert sleeper.restarts == 0


def test_a_child_that_fails_the_same_known_way_twice_is_not_restarted_again(tmp_path):
    group = ProcessGroup(tmp_path, classify=classify)
    oom = "print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1 GiB'); raise SystemExit(1)"
    child = group.start("learner", [sys.executable, "-c", oom], restarts=3)
    _wait_exit(child)
    group.check()  # the first out-of-memory exit may be a passing spike: restarted
    assert child.restarts == 1 and child.failure.kind == "GPU out of memory" and not child.repeated
    _wait_exit(child)
    with pytest.raises(ChildDied, match="the same way as before its restart 1: not restarted again"):
        group.check()
    assert child.restarts == 1 and child.log_path.read_text().count("CUDA out of memory") == 2
    group.stop()
    # an unexplained crash (no known failure in its log) keeps its restarts, even when it repeats
    group = ProcessGroup(tmp_path, classify=classify)
    crash = group.start("crashy", [sys.executable, "-c", "raise SystemExit(3)"], restarts=2)
    deadline = time.monotonic() + 10
    while crash.restarts < 2 and time.monotonic() < deadline:
        group.check()
        time.sleep(0.05)
    assert crash.restarts == 2 and not crash.repeated
    group.stop()


def test_resume_arguments(tmp_path):
    assert split_resume(["--resume", str(tmp_path), "--max-minutes", "5"]) == (
        tmp_path,
        ["--max-minutes", "5"],
    )
    assert split_resume([f"--resume={tmp_path}"]) == (tmp_path, [])
    assert split_resume(["--max-minutes", "5"]) == (None, ["--max-minutes", "5"])
    with pytest.raises(SystemExit, match="not a run directory"):
        resumed_config(tmp_path, [])


def test_the_restart_budget_refills_after_a_healthy_period(tmp_path):
    """Two crashes far apart (a broker outage at noon, another at six) each cost one restart of a fresh
    budget, not two of one: the child stayed up `refill_s` in between."""
    marker = tmp_path / "crashed"
    crash_once = (
        f"import pathlib, sys, time; m = pathlib.Path({str(marker)!r})\n"
        "if not m.exists(): m.touch(); sys.exit(2)\n"
        "time.sleep(60)"
    )
    group = ProcessGroup(tmp_path, refill_s=600.0)
    child = group.start("reward", [sys.executable, "-c", crash_once], restarts=1)
    _wait_exit(child)
    group.check()
    assert child.restarts == 1 and child.used == 1
    group.check()  # up for less than refill_s: the budget stays spent
    assert child.used == 1
    child.started -= 601.0  # as if it had stayed up for ten minutes
    group.check()
    assert child.used == 0 and child.restarts == 1  # the total still shows in the progress
    assert "600 s: 1 restarts again" in child.log_path.read_text()
    marker.unlink()
    child.popen.kill()  # the next outage: restarted again, one more from the refilled budget
    _wait_exit(child)
    group.check()
    assert child.restarts == 2 and child.used == 1
    group.stop(grace_s=1)


def test_a_stopped_role_is_noticed_by_the_watchdog_killed_and_restarted(tmp_path):
    """A small fake role beats its heartbeat (runtime/heartbeat.py) every 50 ms; SIGSTOP silences it; past
    `watchdog_s` the group kills it and restarts it through the normal restart path, and it beats again."""
    import os
    import signal

    from deploy.processes import ROOT

    role = (
        "import time\nfrom runtime.heartbeat import Heartbeat\nbeat = Heartbeat.from_env('-0')\n"
        "beat.every_s = 0.05\nprint('serving', flush=True)\nwhile True:\n    beat()\n    time.sleep(0.05)\n"
    )
    restarted = []
    group = ProcessGroup(
        tmp_path,
        env={"PYTHONPATH": str(ROOT)},
        watchdog_s=1.0,
        on_restart=lambda c, code: restarted.append(code),
    )
    child = group.start("reward", [sys.executable, "-c", role], restarts=2)
    beat = tmp_path / "heartbeats" / "reward-0"
    _until(lambda: beat.is_file(), "the first heartbeat")
    for _ in range(5):
        group.check()  # beating: left alone
        time.sleep(0.3)
    assert child.restarts == 0
    first = child.popen.pid
    os.kill(first, signal.SIGSTOP)
    _until(lambda: (group.check(), restarted)[1], "a restart by the watchdog", timeout_s=20.0)
    assert restarted == [-signal.SIGKILL] and child.popen.pid != first
    assert child.failure.kind == "no progress" and "--watchdog-s" in child.failure.fix
    log = child.log_path.read_text()
    assert "no progress for" in log and log.count("serving") >= 1
    _until(lambda: beat.stat().st_mtime >= child.spawned, "a heartbeat of the restarted role")
    group.stop(grace_s=1)


def _until(ready, what, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)
