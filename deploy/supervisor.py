"""The processes of one launch and what the launcher reports about them (`Supervisor`).

Two process groups (deploy/processes.py): `infra` (the build and task children, the broker, the MPS
daemon) and `roles` (reward service, warm start, GEMM check, generator, learner), each child in its own
session with its log in <run_dir>/logs/. The supervisor starts a stage's child (`start`), waits for it
while checking that every other process is still up (`wait`), counts and shows restarts, and keeps the
run's records: the live status and progress display (deploy/progress.py), events.jsonl (one JSON line
per event: stage, plan, notice, restart, error, stopping, stopped) and pids.json. `stop_all` stops the
roles newest first, then the MPS daemon, then the broker. Used by deploy/launcher.py and the stage
runners in deploy/stages.py.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from deploy.failures import classify
from deploy.gpus.mps import MpsDaemon
from deploy.preflight import explain_failure
from deploy.processes import Child, ChildDied, ProcessGroup, tail
from deploy.progress import Progress, RunStatus
from runtime import jsonl


class Supervisor:
    """A launch's process groups, live status, progress display and run records."""

    def __init__(
        self,
        run_dir: Path,
        env: dict[str, str],
        max_restarts: int,
        refill_s: float = 600.0,
        watchdog_s: float = 0.0,
    ):
        self.run_dir = run_dir
        self.max_restarts = max_restarts
        """Restarts a child started with `restart=True` gets (the launch's --max-restarts), again after it
        stayed up `refill_s` (--restart-refill-s); a role silent for `watchdog_s` (--watchdog-s) is
        restarted."""
        self.status = RunStatus()
        kw = {
            "on_restart": self._restarted,
            "classify": classify,
            "refill_s": refill_s,
            "watchdog_s": watchdog_s,
        }
        self.infra = ProcessGroup(run_dir, env, **kw)
        self.roles = ProcessGroup(run_dir, env, **kw)
        self.progress: Progress | None = None
        self.mps: MpsDaemon | None = None

    # ------------------------------------------------------------------ processes
    def start(
        self,
        group: ProcessGroup,
        name: str,
        module: str,
        args: list[str],
        critical: bool = True,
        env: dict[str, str] | None = None,
        restart: bool = False,
    ) -> Child:
        """`python -m module args` as child `name` of `group`, restarted after a crash if `restart`."""
        restarts = self.max_restarts if restart else 0
        child = group.python(name, module, args, critical=critical, env=env, restarts=restarts)
        self.write_pids()
        return child

    def check(self) -> None:
        """Raise ChildDied if a critical process of either group died for good (restarting the others)."""
        self.infra.check()
        self.roles.check()

    def wait(self, child: Child, on_tick=None) -> None:
        """Wait for a stage's process to finish successfully (the other processes must stay up)."""
        while child.popen.poll() is None:
            self.check()
            if on_tick:
                on_tick()
            self.progress.show(self.status)
            time.sleep(0.5)
        if on_tick:
            on_tick()
        if child.popen.returncode != 0:
            raise ChildDied(
                f"{child.name} exited with code {child.popen.returncode}; last log lines:\n"
                f"{tail(child.log_path)}"
            )

    def start_mps(self) -> None:
        """Start the run's MPS control daemon and give every role its environment (deploy/gpus/mps.py);
        before any role touches the GPU: a client that finds no daemon runs without MPS."""
        self.mps = MpsDaemon(self.run_dir)
        self.roles.env.update(self.mps.start(self.infra))

    def stop_all(self, outcome: str) -> None:
        """Stop the roles (newest first), then the broker; a second Ctrl-C cannot interrupt this."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.event("stopping", outcome=outcome)
            self.roles.stop()
            if self.mps is not None:
                self.mps.stop()
            self.infra.stop()
            self.event("stopped")
        finally:
            signal.signal(signal.SIGINT, previous)

    def explain(self) -> str:
        """The known fix for the first child that died with a recognisable error ("" if none)."""
        for child in self._children():
            if child.popen.poll() not in (None, 0) or "Error" in tail(child.log_path, 5):
                fix = explain_failure(tail(child.log_path, 300))
                if fix:
                    return f"\n[launcher] {child.name}: {fix}"
        return ""

    def _restarted(self, child: Child, code: int) -> None:
        """A supervised process crashed and was started again: count, log and show it."""
        self.status.restarts[child.name] = child.restarts
        failure = child.failure
        self.event(
            "restart",
            process=child.name,
            exit_code=code,
            restarts=child.restarts,
            **({"failure": failure.kind, "fix": failure.fix} if failure else {}),
        )
        if self.progress is not None:
            known = f" ({failure.kind}: {failure.fix})" if failure else ""
            self.progress.message(
                f"[launcher] {child.name} exited with code {code}{known}: restarted "
                f"({child.used}/{child.max_restarts})"
            )
        self.write_pids()

    def _children(self) -> list[Child]:
        return [c for g in (self.infra, self.roles) for c in g.children]

    # ------------------------------------------------------------------ records
    def stage(self, stage: str, detail: str = "") -> None:
        """Enter a stage: in the status, events.jsonl and the live progress."""
        self.status.stage, self.status.stage_detail = stage, detail
        self.event("stage", stage=stage, detail=detail)
        if self.progress is not None:
            self.progress.message(f"[launcher] stage {stage}" + (f": {detail}" if detail else ""))
            self.progress.show(self.status, force=True)

    def notice(self, text: str) -> None:
        """A line for the user about this run's plan, in the live progress and events.jsonl ("": none)."""
        if text:
            self.event("notice", text=text)
            if self.progress is not None:
                self.progress.message(f"[launcher] {text}")

    def event(self, event: str, **fields) -> None:
        """One line of events.jsonl."""
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(jsonl.dumps({"time": time.time(), "event": event, **fields}) + "\n")

    def write_pids(self) -> None:
        """pids.json: every child's name and process id."""
        pids = {c.name: c.popen.pid for c in self._children()}
        (self.run_dir / "pids.json").write_text(json.dumps(pids, indent=2) + "\n")
