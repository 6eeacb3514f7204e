"""The parts of the fault-injection suite (tests/integration/test_faults.py): a short launcher run,
an independent audit of the broker's streams, and the accounting of what was trained.

* `FaultRun` starts `python -m deploy` on the tiny model with a small task (one epoch, so the run
  finishes by itself once every prompt came back), kills what it is told to with SIGKILL (or stops and
  continues it: `signal`), and measures the time from the fault to the learner's next completed step.
* `Audit` is its own consumer group ("audit") on the prompts, rollouts and scored streams,
  created before the learner publishes anything: it sees every entry published, whoever consumes
  it, and across a broker restart (its group and pending entries live in the AOF like the others).
* `trained_lineage` reads the learner's trained.jsonl (the group ids of each step) and keeps, per
  step number, the last time it was trained: steps past a checkpoint that were lost with a killed
  learner were trained again after its restart, and only that second time reached the weights.

Setting PARALLAX_FAULT_REPORT=path makes each test add its measurements to that JSON file;
`python -m bench.faults` runs the suite that way and prints the table of docs/fault-tolerance.md.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections import Counter
from pathlib import Path

import broker
from broker import codec
from broker.auth import open_sealed
from broker.config import BrokerConfig
from broker.names import Names, group_id
from broker.schemas import PromptRecord, ScoredGroup
from broker.transport import TransportError
from tests.integration.test_prometheus_scrape import free_ports

ROOT = Path(__file__).resolve().parents[2]
REPORT_ENV = "PARALLAX_FAULT_REPORT"
PROMPTS = 16
"""Training prompts of a run (one epoch, 2 per step: 8 steps), unless a case asks for more."""


class FaultRun:
    """`python -m deploy` on the tiny model, one epoch of `prompts` prompts; the test kills parts of it."""

    def __init__(
        self,
        run_dir: Path,
        broker_kind: str,
        resume: bool = False,
        prompts: int = PROMPTS,
        extra: tuple[str, ...] = (),
    ):
        self.run_dir, self.broker_kind = run_dir, broker_kind
        base = free_ports(3)
        ports = [
            "--reward.metrics.port", str(base), "--generator.metrics.port", str(base + 1),
            "--learner.metrics.port", str(base + 2),
        ]  # fmt: skip
        args = ["--resume", str(run_dir), "--progress", "plain", *ports] if resume else [
            "--run-dir", str(run_dir), "--preset", "tiny", "--progress", "plain", "--broker", broker_kind,
            "--max-minutes", "6", "--task.train", str(prompts), "--task.test", "4", "--task.image-size", "56",
            "--warm-start.steps", "1", "--warm-start.batch", "2",
            "--learner.algo.groups-per-step", "2", "--learner.algo.no-dynamic-sampling",
            "--learner.eval.every", "0", "--learner.feeder.epochs", "1", "--learner.checkpoint.every", "2",
            "--learner.broker.claim-idle-s", "600", "--generator.broker.claim-idle-s", "600",
            "--reward.broker.claim-idle-s", "600",
            "--generator.sampling.n", "2", "--generator.sampling.max-tokens", "4", *ports, *extra,
        ]  # fmt: skip
        self.log_path = run_dir.parent / ("launcher-resumed.log" if resume else "launcher.log")
        self.log = open(self.log_path, "wb")  # noqa: SIM115
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy", *args],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def wait_for(self, what: str, ready, timeout_s: float = 240.0, poll_s: float = 0.1):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = ready()
            if value:
                return value
            assert self.proc.poll() is None, f"launcher exited before {what}:\n{self.log_text()}"
            time.sleep(poll_s)
        raise AssertionError(f"no {what} within {timeout_s} s:\n{self.log_text()}")

    def broker_and_names(self, not_url: str = "") -> tuple[str, Names]:
        """The broker url (with the run's password in it) and names of this run's roles, once their
        configs are written (other than the configs whose url is `not_url`)."""

        def configs():
            cfg = _toml(self.run_dir / "configs" / "learner.toml")
            return cfg if cfg and _connect_url(cfg) != not_url else None

        cfg = self.wait_for("role configs", configs, poll_s=0.05)
        return _connect_url(cfg), Names(cfg["broker"]["namespace"])

    def trained_lines(self) -> list[dict]:
        path = self.run_dir / "learner" / "trained.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []

    def metrics_lines(self) -> list[dict]:
        path = self.run_dir / "learner" / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []

    def checkpoints(self) -> list[Path]:
        """The learner's complete checkpoint directories, newest first."""
        root = self.run_dir / "learner" / "checkpoints"
        done = [
            p for p in root.glob("step-*") if not p.name.endswith(".tmp") and (p / "manifest.json").is_file()
        ]
        return sorted(done, reverse=True)

    def kill(self, process: str) -> float:
        """SIGKILL `process` (its whole process group, grandchildren included); returns the wall time."""
        return self.send(process, signal.SIGKILL)

    def send(self, process: str, sig: int) -> float:
        """Send `sig` to `process` (its whole process group, grandchildren included); returns the wall time.
        Waits for pids.json to name a live one (a role may be between a restart and its new pid); fails
        with the launcher's log if the run ended first."""

        def live_pid():
            pid = json.loads((self.run_dir / "pids.json").read_text())[process]
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return None
            return pid

        pid = self.wait_for(f"a live {process} to kill", live_pid, timeout_s=60.0)
        when = time.time()
        if process == "redis":
            os.kill(pid, sig)
        else:
            os.killpg(pid, sig)
        return when

    def second_learner(self, *extra: str) -> subprocess.Popen:
        """`python -m learner` with the run's learner config (and `extra` flags), as a user could start it."""
        config = self.run_dir / "configs" / "learner.toml"
        cmd = [sys.executable, "-m", "learner", "--config", str(config), *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def scale(self, generators: int) -> float:
        """`python -m deploy scale RUN_DIR --generators N`; returns the wall time it was asked."""
        when = time.time()
        cmd = [sys.executable, "-m", "deploy", "scale", str(self.run_dir), "--generators", str(generators)]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        return when

    def role_log(self, process: str) -> str:
        path = self.run_dir / "logs" / f"{process}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def recovery_s(self, killed_at: float, restarted_at: float) -> float | None:
        """Seconds from the kill to the first learner step completed after the restart.

        None when the run finished without one: a role killed late (the generator after it sampled
        the epoch's last prompt) may not be needed again, and the learner trains the rest without it.
        The test's accounting still covers that run; there is just no recovery to time.
        """

        def step_or_end():
            line = _first_after(self.trained_lines(), restarted_at)
            return line or (self.proc.poll() is not None and {"ended": True})

        line = self.wait_for("a step after the restart", step_or_end)
        return None if "ended" in line else line["time"] - killed_at

    def finish(self, timeout_s: float = 300.0) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"the run did not finish within {timeout_s} s:\n{self.log_text()}") from exc

    def events(self, kind: str) -> list[dict]:
        lines = (self.run_dir / "events.jsonl").read_text().splitlines()
        return [e for e in map(json.loads, lines) if e["event"] == kind]

    def interrupt(self) -> int:
        """Ctrl-C the launcher (it stops every process it started) and wait for it."""
        self.proc.send_signal(signal.SIGINT)
        return self.finish(timeout_s=120)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _toml(path: Path) -> dict | None:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None


def _connect_url(cfg: dict) -> str:
    """A role config's broker url with the password of its password file in it."""
    section = cfg["broker"]
    return BrokerConfig(url=section["url"], password_file=section.get("password_file", "")).connect_url()


def _first_after(lines: list[dict], when: float) -> dict | None:
    return next((x for x in lines if x["time"] > when), None)


class Audit(threading.Thread):
    """Its own consumer group on the prompts, rollouts and scored streams: counts every entry."""

    GROUP = "audit"

    def __init__(self, url: str, names: Names):
        super().__init__(daemon=True, name="audit")
        self.transport = broker.connect(url, reconnect_s=60)  # no message key: reads signed entries unchecked
        self.streams = [names.prompts, names.rollouts, names.scored]
        for stream in self.streams:
            self.transport.ensure_group(stream, self.GROUP)
        self.names = names
        self.expected: list[str] = []
        """Group ids of the training prompts published (prompt id @ prompt entry id)."""
        self.counts: dict[str, Counter] = {s: Counter() for s in self.streams}
        """Training group id -> entries seen, per stream (rollouts, scored)."""
        self.entries: Counter = Counter()
        """Training group entries seen per stream."""
        self.error: BaseException | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                for stream in self.streams:
                    self._read(stream)
        except TransportError:
            pass  # the broker stopped with the run
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def _read(self, stream: str) -> None:
        got = self.transport.consume(stream, self.GROUP, "auditor", count=200, block_s=0.05)
        for delivery in got:
            msg = codec.decode(open_sealed(None, stream, delivery.payload))
            if isinstance(msg, PromptRecord):
                if msg.split == "train":
                    self.expected.append(group_id(msg.prompt_id, delivery.id))
            else:
                group = msg.group if isinstance(msg, ScoredGroup) else msg
                if group.split == "train":
                    self.counts[stream][group.group_id] += 1
                    self.entries[stream] += 1
        if got:
            self.transport.ack(stream, self.GROUP, [d.id for d in got])

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=10)


def trained_lineage(lines: list[dict]) -> list[str]:
    """Group ids in the final weights, one entry per time trained (see the module docstring)."""
    by_step: dict[int, list[str]] = {}
    for line in lines:
        step = int(line["step"])
        for later in [s for s in by_step if s >= step]:
            del by_step[later]  # a restarted learner trains these steps again
        by_step[step] = list(line["groups"])
    return [g for step in sorted(by_step) for g in by_step[step]]


def account(expected: list[str], trained: list[str]) -> dict:
    """Every published prompt trained exactly once? Counts of what is not."""
    times = Counter(trained)
    return {
        "published": len(expected),
        "trained": len(set(trained)),
        "lost": len(set(expected) - set(times)),
        "trained_twice": sum(1 for n in times.values() if n > 1),
        "never_published": len(set(times) - set(expected)),
    }


def report(record: dict) -> None:
    """Add one test's measurements to the JSON file named by $PARALLAX_FAULT_REPORT (if set)."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    path = Path(path)
    rows = json.loads(path.read_text()) if path.is_file() else []
    rows = [r for r in rows if (r["fault"], r["broker"]) != (record["fault"], record["broker"])]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([*rows, record], indent=2) + "\n")
