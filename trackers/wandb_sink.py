"""The "wandb" metrics sink: each step's values as a Weights & Biases run, offline unless asked otherwise.

Offline (the default) the run is written under `<run_dir>/wandb/offline-run-<time>-<id>/` and nothing leaves
the machine; upload it later with `wandb sync <that directory>`. Online (`mode = "online"`, $WANDB_API_KEY
set) it streams to the W&B server. The run id is kept in `<run_dir>/wandb/run_id`, so a learner restarted
from a checkpoint goes on in the same W&B run (`resume="allow"`; online, W&B drops points logged again at
steps it already has, with a warning).

The run's config is the learner's resolved config with URL passwords replaced by *** (runtime/redact.py), and
the command line W&B records with the run is redacted the same way; the API key is never written (W&B reads
it from the environment).
"""

from __future__ import annotations

import secrets
import sys
from contextlib import contextmanager
from pathlib import Path

from runtime.redact import redact
from trackers.config import WandbConfig
from trackers.sinks import Sink, scalars


class WandbSink(Sink):
    """One W&B run, started at the first step logged."""

    name = "wandb"

    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict):
        import wandb  # here: only a run that asks for the sink needs wandb

        self._wandb = wandb
        self.cfg = cfg
        self.run_dir = run_dir
        self.config = config
        self.run = None

    def log(self, step: int, values: dict, wall_time: float) -> None:
        if self.run is None:
            self.run = self._init()
        self.run.log(scalars(values), step=step)

    def close(self) -> None:
        """Finish the run and stop W&B's service process, which writes the run's last records to disk
        as it stops (after `finish` alone they may still be in flight)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
            self._wandb.teardown()

    def _init(self):
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with _redacted_argv():
            return self._wandb.init(
                project=self.cfg.project,
                entity=self.cfg.entity or None,
                name=self.cfg.name or run_name(self.run_dir),
                tags=list(self.cfg.tags) or None,
                config=self.config,
                dir=str(self.run_dir),
                mode=self.cfg.mode,
                id=self._run_id(),
                resume="allow",
            )

    def _run_id(self) -> str:
        path = self.run_dir / "wandb" / "run_id"
        if path.exists():
            return path.read_text().strip()
        run_id = secrets.token_hex(6)  # W&B run ids: letters and digits, unique within the project
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(run_id + "\n")
        return run_id


def run_name(run_dir: Path) -> str:
    """The run directory's name; for `<run>/learner` (what `python -m deploy` lays out), the run's."""
    run_dir = run_dir.resolve()
    return run_dir.parent.name if run_dir.name == "learner" else run_dir.name


@contextmanager
def _redacted_argv():
    """sys.argv with URL passwords replaced by *** while W&B records the command line."""
    argv = sys.argv
    sys.argv = [redact(arg) for arg in argv]
    try:
        yield
    finally:
        sys.argv = argv
