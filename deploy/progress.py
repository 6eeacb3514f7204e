"""Live progress of a launcher run: what the stages and the learner report, shown as it happens.

`RunStatus` folds the run's JSON-lines files (the warm start's per-step lines, the learner's
metrics.jsonl) and the generator's Prometheus counters into the numbers worth watching: stage,
step, reward, held-out accuracy, staleness, tokens/s. `Progress` shows them as a rich live table
on a terminal, or as one plain line every few seconds elsewhere (logs, CI, tests).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self


class JsonlTail:
    """Reads the complete lines appended to a JSON-lines file since the last call."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


def scrape(url: str, names: tuple[str, ...], timeout_s: float = 0.5) -> dict[str, float]:
    """Sum of every sample of each metric in `names` at a Prometheus endpoint ({} when unreachable)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


class Rate:
    """Per-second rate of a counter over a sliding window of observations."""

    def __init__(self, window_s: float = 15.0):
        self.window_s = window_s
        self.points: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: float) -> None:
        self.points.append((now, value))
        while len(self.points) > 2 and now - self.points[0][0] > self.window_s:
            self.points.popleft()

    @property
    def value(self) -> float | None:
        if len(self.points) < 2:
            return None
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else None


@dataclass
class RunStatus:
    """The numbers the progress display shows; `update` folds new JSON lines in."""

    started: float = field(default_factory=time.time)
    stage: str = "setup"
    stage_detail: str = ""
    warm_step: int = 0
    warm_steps: int = 0
    warm_loss: float | None = None
    step: int = 0
    reward: float | None = None
    reward_avg: deque = field(default_factory=lambda: deque(maxlen=10))
    accuracy: float | None = None
    staleness: float | None = None
    learner_tokens_per_s: float | None = None
    step_s: float | None = None
    eval_accuracy: float | None = None
    eval_round: int | None = None
    evals: list[tuple[float, int, float]] = field(default_factory=list)
    generator_tokens: Rate = field(default_factory=Rate)
    skipped: dict[str, float] = field(default_factory=dict)
    restarts: dict[str, int] = field(default_factory=dict)
    """Process name -> times the launcher restarted it after a crash."""

    def warm(self, lines: list[dict]) -> None:
        for line in lines:
            self.warm_step, self.warm_steps = int(line["step"]), int(line["steps"])
            self.warm_loss = float(line.get("loss", "nan"))  # a non-finite loss is left out of the line

    def learner(self, lines: list[dict]) -> None:
        for line in lines:
            if "step" in line:
                self.step = int(line["step"])
            if "reward_mean" in line and line.get("groups"):
                self.reward = line["reward_mean"]
                self.reward_avg.append(line["reward_mean"])
                self.accuracy = line.get("accuracy")
            if "staleness_mean" in line:
                self.staleness = line["staleness_mean"]
            if line.get("train_s"):
                self.step_s = line["train_s"] + line.get("wait_s", 0.0) + line.get("sync_s", 0.0)
                self.learner_tokens_per_s = line.get("tokens_per_s")
            if "eval/accuracy" in line:
                self.eval_accuracy = line["eval/accuracy"]
                self.eval_round = int(line.get("eval/round", -1))
                self.evals.append((line.get("time", time.time()), self.eval_round, self.eval_accuracy))
            self.skipped.update(
                {k.removeprefix("skipped/"): v for k, v in line.items() if k.startswith("skipped/")}
            )

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs, in display order."""
        minutes = (time.time() - self.started) / 60
        stage = self.stage + (f" ({self.stage_detail})" if self.stage_detail else "")
        rows = [("elapsed", f"{minutes:5.1f} min"), ("stage", stage)]
        if self.warm_steps:
            loss = f", loss {self.warm_loss:.3f}" if self.warm_loss is not None else ""
            rows.append(("warm-start", f"{self.warm_step}/{self.warm_steps}{loss}"))
        avg = sum(self.reward_avg) / len(self.reward_avg) if self.reward_avg else None
        rows += [
            ("step", f"{self.step}" + (f"  ({self.step_s:.1f} s/step)" if self.step_s else "")),
            ("reward", f"{_f(self.reward)}  (avg of last {len(self.reward_avg)}: {_f(avg)})"),
            ("train accuracy", _f(self.accuracy)),
            (
                "held-out accuracy",
                _f(self.eval_accuracy)
                + (f"  (eval at step {self.eval_round})" if self.eval_round is not None else ""),
            ),
            ("staleness", _f(self.staleness, ".2f") + " versions (mean, last step)"),
            (
                "tokens/s",
                (
                    f"generator {_f(self.generator_tokens.value, '.0f')}, "
                    f"learner {_f(self.learner_tokens_per_s, '.0f')}"
                ),
            ),
        ]
        if self.skipped:
            rows.append(
                ("skipped groups", ", ".join(f"{k} {v:.0f}" for k, v in sorted(self.skipped.items())))
            )
        if self.restarts:
            rows.append(("restarts", ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items()))))
        return rows

    def line(self) -> str:
        """The rows that hold a value, on one line."""
        return " | ".join(f"{k} {v}" for k, v in self.rows() if not v.startswith("-"))


def _f(value, fmt: str = ".3f") -> str:
    return "-" if value is None else format(value, fmt)


class Progress:
    """Shows a RunStatus: a rich live table (`rich`), a line every `every_s` (`plain`) or nothing (`off`,
    where only `error` prints, on stderr)."""

    def __init__(self, mode: str = "auto", every_s: float = 10.0, title: str = "Parallax"):
        if mode == "auto":
            mode = "rich" if sys.stdout.isatty() else "plain"
        self.mode, self.every_s, self.title = mode, every_s, title
        self._live = None
        self._last = 0.0

    def __enter__(self) -> Self:
        if self.mode == "rich":
            from rich.live import Live

            self._live = Live(auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def show(self, status: RunStatus, force: bool = False) -> None:
        if self.mode == "rich":
            self._live.update(self._table(status), refresh=True)
        elif self.mode == "plain" and (force or time.monotonic() - self._last >= self.every_s):
            self._last = time.monotonic()
            print(status.line(), flush=True)

    def message(self, text: str) -> None:
        if self.mode == "rich":
            self._live.console.print(text, markup=False, highlight=False)
        elif self.mode == "plain":
            print(text, flush=True)

    def error(self, text: str) -> None:
        """A message that ends the run: shown as `message` shows it, and on stderr where the display is off
        (a launcher run by a script must still say why it failed)."""
        if self.mode == "off":
            print(text, file=sys.stderr, flush=True)
        else:
            self.message(text)

    def _table(self, status: RunStatus):
        from rich.table import Table

        table = Table(title=self.title, show_header=False, min_width=60)
        table.add_column(style="bold cyan")
        table.add_column()
        for label, value in status.rows():
            table.add_row(label, value)
        return table

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
