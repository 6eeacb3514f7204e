"""The CPU demo with each policy loss, side by side: held-out accuracy over minutes and steps.

    python -m bench.losses_demo [--policies ppo-clip gspo cispo sapo] [--max-steps 80] [--max-minutes 12]

Runs the all-in-one launcher (`python -m deploy`, the demo's settings) once per policy loss, one
after the other on this machine, with the same seeds and the same extra flags for all of them
(`--extra`, default: two PPO mini-batches per batch with a recomputed π_prox and no off-policy
correction, so that π_θ moves off π_prox and the surrogates differ; with one mini-batch and a
detached π_prox every surrogate has the same gradient). Each run stops after `--max-steps` learner
steps (steps are what the shared cores' load does not stretch) or `--max-minutes`, whichever comes
first. Reads each run's summary.json and
learner/metrics.jsonl and writes bench/results/losses_demo.json: the exact commands, every
held-out evaluation (minutes since launch, step, greedy accuracy on 64 unseen images), minutes
and steps to the target accuracy with their ratio to the first policy's, the mean clipped
fraction of tokens, and the machine's load average around each run (the 2 cores are shared).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tyro

from bench.common import write_result

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_EXTRA = (
    "--learner.algo.mini-batches",
    "2",
    "--learner.algo.proximal",
    "recompute",
    "--learner.loss.correction.type",
    "none",
)

NO_METRICS_PORTS = (
    "--learner.metrics.port",
    "0",
    "--generator.metrics.port",
    "0",
    "--reward.metrics.port",
    "0",
)
"""No Prometheus ports: another demo on the shared machine may hold the demo's fixed ones."""


@dataclass
class BenchConfig:
    """`python -m bench.losses_demo`: one demo run per policy loss."""

    policies: tuple[str, ...] = ("ppo-clip", "gspo", "cispo", "sapo")
    """Policy losses to run, in order (the first is the reference of the ratios)."""
    max_steps: int = 80
    """Stop each run after this many learner steps."""
    max_minutes: float = 12.0
    """... or after this many minutes from its launch, whichever comes first."""
    target: float = 0.8
    """Held-out accuracy whose first crossing is reported."""
    extra: tuple[str, ...] = DEFAULT_EXTRA
    """Flags passed to every run, before `--learner.loss.policy.type`."""
    runs_dir: str = "runs/losses_demo"
    """Parent of the run directories (one per policy)."""
    out: str = "bench/results/losses_demo.json"
    """Where the results go."""
    collect_only: bool = False
    """Do not run anything: read the run directories a previous invocation left under `runs_dir`."""


def command(cfg: BenchConfig, policy: str) -> list[str]:
    """The launcher command of one run."""
    run_dir = f"{cfg.runs_dir}/{policy}"
    return [
        "python", "-m", "deploy", "--max-minutes", str(cfg.max_minutes),
        "--learner.max-steps", str(cfg.max_steps), "--run-dir", run_dir,
        *NO_METRICS_PORTS, *cfg.extra, "--learner.loss.policy.type", policy,
    ]  # fmt: skip


def read_run(run_dir: Path, target: float) -> dict:
    """Summary numbers of one finished run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = [json.loads(x) for x in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines() if x]
    trained = [s for s in steps if "clipped_frac" in s]
    hit = next((e for e in summary["evals"] if e["accuracy"] >= target), None)
    rewards = [s["reward_mean"] for s in steps if "reward_mean" in s]
    return {
        "steps": summary["steps"],
        "minutes": round(summary["minutes"], 2),
        "first_eval_accuracy": summary["first_eval_accuracy"],
        "final_eval_accuracy": summary["final_eval_accuracy"],
        "best_eval_accuracy": summary["best_eval_accuracy"],
        "minutes_to_target": hit["minutes"] if hit else None,
        "step_to_target": hit["step"] if hit else None,
        "clipped_frac_mean": round(sum(s["clipped_frac"] for s in trained) / len(trained), 4)
        if trained
        else None,
        "train_reward_first10": round(sum(rewards[:10]) / len(rewards[:10]), 3) if rewards else None,
        "train_reward_last10": round(sum(rewards[-10:]) / len(rewards[-10:]), 3) if rewards else None,
        "evals": summary["evals"],
    }


def main(cfg: BenchConfig) -> dict:
    results: dict[str, dict] = {}
    commands: dict[str, str] = {}
    for policy in cfg.policies:
        cmd = command(cfg, policy)
        commands[policy] = " ".join(cmd)
        load_before = os.getloadavg()
        if not cfg.collect_only:
            print(f"[losses_demo] {commands[policy]}", flush=True)
            subprocess.run(
                [sys.executable, *cmd[1:]],
                cwd=ROOT,
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        results[policy] = read_run(ROOT / cfg.runs_dir / policy, cfg.target)
        if not cfg.collect_only:
            load = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
            results[policy]["load_avg_1m_before_after"] = load
    ref = results[cfg.policies[0]]
    for r in results.values():
        for key in ("minutes_to_target", "step_to_target"):
            both = r[key] is not None and ref[key]
            r[f"{key}_vs_{cfg.policies[0]}"] = round(r[key] / ref[key], 3) if both else None
    out = {
        "target": cfg.target,
        "commands": commands,
        "runs": results,
    }
    write_result(out, ROOT / cfg.out)
    t = cfg.target
    print(f"| policy | steps | min to {t} | step to {t} | best | final | clipped |")
    for policy, r in results.items():
        print(
            f"| {policy} | {r['steps']} | {r['minutes_to_target']} | {r['step_to_target']} | "
            f"{r['best_eval_accuracy']} | {r['final_eval_accuracy']} | {r['clipped_frac_mean']} |"
        )
    return out


if __name__ == "__main__":
    main(tyro.cli(BenchConfig))
