"""The "tensorboard" metrics sink: each step's values as TensorBoard scalars, written by tensorboardX.

tensorboardX writes TensorBoard's event-file format with nothing but numpy and protobuf (an 88 kB wheel; the
`tensorboard` package, a 5.5 MB wheel plus a 6.6 MB data server, is needed only to view the files):

    tensorboard --logdir runs/<run>/learner/tensorboard

The writer opens at the first step it gets, with that step as its purge step: after a restart from a
checkpoint, TensorBoard drops the earlier run's points from that step on, so each step shows once.
"""

from __future__ import annotations

import time
from pathlib import Path

from trackers.sinks import Sink, scalars


class TensorBoardSink(Sink):
    """Scalars under `logdir` (one event file per start of the process)."""

    name = "tensorboard"

    def __init__(self, logdir: Path):
        from tensorboardX import SummaryWriter  # here: only a run that asks for the sink needs tensorboardX

        self._writer_class = SummaryWriter
        self.logdir = logdir
        self.writer = None

    def log(self, step: int, values: dict, wall_time: float) -> None:
        if self.writer is None:
            self.logdir.mkdir(parents=True, exist_ok=True)
            # the file is named by the second it opens in: a suffix keeps a restart within it from reusing it
            suffix = f".{time.time_ns()}"
            self.writer = self._writer_class(logdir=str(self.logdir), purge_step=step, filename_suffix=suffix)
        for key, value in scalars(values).items():
            self.writer.add_scalar(key, value, global_step=step, walltime=wall_time)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
