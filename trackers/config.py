"""The `metrics` section of a role that also logs to experiment trackers (the learner's).

`TrackedMetricsConfig` is `runtime.metrics.MetricsConfig` (the Prometheus server) plus `sinks`: the trackers
each step's values go to beside metrics.jsonl, chosen by name, and one table of settings per tracker:

    [metrics]                           # --metrics.sinks tensorboard wandb
    sinks = ["tensorboard", "wandb"]
    [metrics.wandb]                     # --metrics.wandb.project my-project --metrics.wandb.tags a b
    project = "my-project"

Under `python -m deploy` the same section is `[learner.metrics]` (`--learner.metrics.sinks ...`). Nothing
here imports a tracker: `validate()` only checks that the package a chosen sink needs is installed, so a
run that asks for a missing one stops at once with one line naming it. The W&B API key is read from
$WANDB_API_KEY only (never a config field, so never in a resolved config or a log).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Literal

from runtime.metrics import MetricsConfig

Sink = Literal["tensorboard", "wandb"]
PACKAGES: dict[str, tuple[str, str]] = {
    # sink -> (module imported, pip requirement; the version requirements.txt pins)
    "tensorboard": ("tensorboardX", "tensorboardX==2.6.5"),
    "wandb": ("wandb", "wandb==0.31.0"),
}
API_KEY_ENV = "WANDB_API_KEY"


@dataclass
class TensorBoardConfig:
    """The TensorBoard sink (trackers/tensorboard_sink.py): event files written by tensorboardX."""

    dir: str = ""
    """Directory of the event files; empty = `<run_dir>/tensorboard` (`tensorboard --logdir` on it)."""


@dataclass
class WandbConfig:
    """The Weights & Biases sink (trackers/wandb_sink.py)."""

    mode: Literal["offline", "online"] = "offline"
    """"offline": the run is written under `<run_dir>/wandb/` only (upload it later with `wandb sync DIR`);
    "online": streamed to the W&B server, which needs $WANDB_API_KEY in the environment."""
    project: str = "parallax"
    """W&B project of the run."""
    entity: str = ""
    """W&B entity (user or team); empty = the API key's default entity."""
    name: str = ""
    """Display name of the run; empty = the run directory's name (the run id under `python -m deploy`)."""
    tags: list[str] = field(default_factory=list)
    """Tags of the run."""

    def validate(self) -> None:
        if not self.project:
            raise ValueError("project must not be empty")


@dataclass
class TrackedMetricsConfig(MetricsConfig):
    """Where this process serves its Prometheus metrics, and the experiment trackers it logs each step to."""

    sinks: list[Sink] = field(default_factory=list)
    """Experiment trackers that get every step's values, beside metrics.jsonl (always written) and the
    Prometheus gauges: "tensorboard", "wandb" (rank 0 only; a tracker that fails is dropped with one warning,
    training goes on). Each needs its package: tensorboardX, wandb (requirements.txt pins both)."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """Settings of the "tensorboard" sink."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Settings of the "wandb" sink."""

    def validate(self) -> None:
        super().validate()
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError(f"sinks {self.sinks} names one twice")
        for sink in self.sinks:
            module, requirement = PACKAGES[sink]
            if not installed(module):
                raise ValueError(f'sink "{sink}" needs the {module} package: pip install {requirement}')
        if "wandb" in self.sinks and self.wandb.mode == "online" and not os.environ.get(API_KEY_ENV):
            raise ValueError(
                f'wandb.mode = "online" needs ${API_KEY_ENV} in the environment (the key is never read from '
                'a config); mode = "offline" writes the run locally for `wandb sync`'
            )


def installed(module: str) -> bool:
    """Whether `module` can be imported (looked up, not imported)."""
    return importlib.util.find_spec(module) is not None
