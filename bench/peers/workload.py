"""The one workload every system of the comparison runs, and how its throughput is counted.

bench.e2e's reference workload on one GPU: random weights with Qwen2.5-VL shapes, the synthetic colour
task at 448 x 448 (256 image tokens a prompt), 128 prompts a step in groups of 5 (640 samples trained a
step, in one optimizer update), 512 response tokens forced (end-of-sequence suppressed until then),
learning rate 1e-6, KL to the reference policy at coefficient 0.01, bf16. Each peer's launch script
(bench/peers/trl_grpo.py, bench/peers/verl_grpo.py) maps these numbers onto its own configuration.

Throughput is counted the same way for every system: prompt + response tokens of the samples trained in
a step (image tokens included), per second of a step, per GPU. A step's seconds are the wall time between
the ends of consecutive steps, after the warm-up steps.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """The shared numbers (bench.e2e's defaults for `--device cuda`)."""

    prompts_per_step: int = 128
    """Prompts a step; one optimizer update a step."""
    group: int = 5
    """Samples per prompt (GRPO group)."""
    response: int = 512
    """Response tokens, forced: every sample is exactly this long."""
    image_side: int = 448
    """Square image side in pixels (448 -> 256 image tokens)."""
    lr: float = 1e-6
    """Learning rate (deploy/configs/learner.toml)."""
    kl_coef: float = 0.01
    """KL to the reference policy (every system computes the reference pass)."""
    warmup: int = 1
    """Steps not measured (engine start, compilation, first weight sync)."""
    steps: int = 2
    """Measured steps."""

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.group

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps


WORKLOAD = Workload()


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """The workload's numbers as a launch script's flags, WORKLOAD's values their defaults."""
    w = WORKLOAD
    parser.add_argument("--prompts", type=int, default=w.prompts_per_step)
    parser.add_argument("--group", type=int, default=w.group)
    parser.add_argument("--response", type=int, default=w.response)
    parser.add_argument("--lr", type=float, default=w.lr)
    parser.add_argument("--kl-coef", type=float, default=w.kl_coef)
    parser.add_argument("--warmup", type=int, default=w.warmup)
    parser.add_argument("--steps", type=int, default=w.steps)


def step_seconds(step_end_times: list[float], warmup: int) -> list[float]:
    """Seconds of each measured step: the gaps between consecutive step ends from the last warm-up
    step's end on (the first step has no earlier end, so at least one warm-up step is needed)."""
    if warmup < 1:
        raise ValueError("at least one warm-up step: a step's time is measured from the previous step's end")
    ends = step_end_times[warmup - 1 :]
    if len(ends) < 2:
        raise ValueError(f"{len(step_end_times)} steps finished: none measured after {warmup} warm-up")
    return [b - a for a, b in zip(ends, ends[1:])]


def throughput(tokens_per_step: float, seconds: list[float], gpus: int = 1) -> dict:
    """A system's row figures from its measured steps: mean step seconds and tokens/s/GPU over them."""
    step_s = statistics.fmean(seconds)
    return {
        "steps": len(seconds),
        "step_s": step_s,
        "per_step_s": list(seconds),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s_per_gpu": tokens_per_step / step_s / gpus,
        "gpus": gpus,
    }
