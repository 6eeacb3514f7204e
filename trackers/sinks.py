"""Where a step's metric values go: one `Sink` interface, one implementation per tracker, chosen by name.

    sinks = Sinks.open(run_dir, cfg.metrics, config=to_dict(cfg))   # metrics.jsonl + the chosen trackers
    sinks.log({"step": 1, "reward_mean": 0.5, "eval/accuracy": 0.25})
    sinks.close()

`JsonlSink` (always on) appends one strict-JSON line per step to `<run_dir>/metrics.jsonl`, as the learner
always has; "tensorboard" (trackers/tensorboard_sink.py) and "wandb" (trackers/wandb_sink.py) get the same
finite numbers at the same step (`values["step"]`), their keys unchanged (a `/` groups them in both UIs).
A tracker's package is imported only when its sink opens. A sink that raises (disk full, W&B unreachable)
is dropped with one warning and the others go on: metrics never stop training.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from pathlib import Path

from runtime import jsonl
from runtime.metrics import MetricsConfig
from trackers.config import PACKAGES, TrackedMetricsConfig

log = logging.getLogger(__name__)


class Sink(ABC):
    """One destination of the step values."""

    name: str

    @abstractmethod
    def log(self, step: int, values: dict, wall_time: float) -> None:
        """Record `values` (a step's metrics, as the learner logs them) at `step`."""

    def close(self) -> None:  # noqa: B027 - a sink that holds nothing has nothing to release
        """Flush and release what the sink holds."""


class JsonlSink(Sink):
    """`<run_dir>/metrics.jsonl`: one JSON line per step, with its wall time (a NaN value is left out)."""

    name = "jsonl"

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, values: dict, wall_time: float) -> None:
        line = {"time": wall_time, **{k: _jsonable(v) for k, v in values.items()}}
        with open(self.path, "a") as f:
            f.write(jsonl.dumps(line) + "\n")  # a NaN value (no such sample this step): key left out


def scalars(values: dict) -> dict[str, float]:
    """The finite numbers of `values` as floats, but the step itself (the x axis of every tracker)."""
    out = {}
    for key, value in values.items():
        if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
            out[key] = float(value)
    return out


class Sinks:
    """The open sinks of one process; `log` and `close` go to each, and a sink that fails is dropped."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    @classmethod
    def open(cls, run_dir: str | Path, cfg: MetricsConfig | None = None, config: dict | None = None):
        """metrics.jsonl in `run_dir`, then the trackers `cfg.sinks` names (a TrackedMetricsConfig's; a
        plain MetricsConfig has none), each started at the first step it gets (so that it knows where a
        restarted run goes on). `config`: the run's resolved config, secrets redacted (stored with W&B's)."""
        run_dir = Path(run_dir)
        sinks: list[Sink] = [JsonlSink(run_dir)]
        for name in getattr(cfg, "sinks", ()):
            sinks.append(_tracker(name, run_dir, cfg, config or {}))
        return cls(sinks)

    def log(self, values: dict) -> None:
        """Hand one step's values to every sink (the step is `values["step"]`)."""
        step, now = int(values.get("step", 0)), time.time()
        for sink in list(self.sinks):
            try:
                sink.log(step, values, now)
            except Exception as exc:  # a tracker's failure must not stop training
                self._drop(sink, exc)

    def close(self) -> None:
        for sink in list(self.sinks):
            try:
                sink.close()
            except Exception as exc:  # one warning, then gone
                self._drop(sink, exc)
        self.sinks = []

    @property
    def names(self) -> list[str]:
        return [sink.name for sink in self.sinks]

    def _drop(self, sink: Sink, exc: Exception) -> None:
        log.warning("metrics sink %s failed and is dropped (training goes on): %r", sink.name, exc)
        self.sinks.remove(sink)
        try:
            sink.close()
        except Exception:  # already reported; a broken sink may fail again on close
            pass


def _tracker(name: str, run_dir: Path, cfg: TrackedMetricsConfig, config: dict) -> Sink:
    """The sink `name`; its package missing is a one-line error naming it (validate() says so earlier)."""
    module, requirement = PACKAGES[name]
    try:
        if name == "tensorboard":
            from trackers.tensorboard_sink import TensorBoardSink

            logdir = Path(cfg.tensorboard.dir) if cfg.tensorboard.dir else run_dir / "tensorboard"
            return TensorBoardSink(logdir)
        from trackers.wandb_sink import WandbSink

        return WandbSink(cfg.wandb, run_dir, config)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise MissingPackage(
            f'metrics sink "{name}" needs the {module} package: pip install {requirement}'
        ) from None


class MissingPackage(RuntimeError):
    """A sink was asked for whose tracker package is not installed."""


def _jsonable(value):
    return float(value) if isinstance(value, (int, float)) else value
