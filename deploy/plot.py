"""PNG plots of runs: training reward and held-out accuracy over wall-clock minutes.

`run_curve(run_dir)` reads a launcher run directory (events.jsonl for the launch time and the
stages, learner/metrics.jsonl for the per-step reward and the evaluations); `plot_runs` draws
one or more runs into one PNG (matplotlib, Agg backend: no display needed). The launcher writes
`<run_dir>/curve.png` at the end of every run; for several runs side by side (demo vs control):

    python -m deploy.plot runs/A runs/B --labels demo "control (shuffled images)" --out docs/demo_curve.png \
        [--summary runs.json]

`summarize(curve, outcome, target)` gives a run's headline numbers (the launcher's summary.json;
`--summary` writes them for every run given, by label).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Curve:
    """One run's curves, times in minutes since the launch."""

    label: str
    reward_t: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    eval_t: list[float] = field(default_factory=list)
    eval_acc: list[float] = field(default_factory=list)
    eval_step: list[int] = field(default_factory=list)
    stages: dict[str, tuple[float, float]] = field(default_factory=dict)
    """stage -> (start, end) minutes."""
    chance: float = math.nan
    mismatch_kl: list[float] = field(default_factory=list)
    """Per training step (aligned with `reward`): k3 KL between the generator's behaviour logprobs and the
    learner's at the same weights (samples of the current version only: the engine mismatch importance
    correction exists for); NaN on a step without such samples."""
    behaviour_kl: list[float] = field(default_factory=list)
    """Per training step: the same KL over all trained samples, stale ones included (mismatch + policy
    change since the sample's version)."""


def _jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def run_curve(run_dir: str | Path, label: str = "") -> Curve:
    """The curves of one launcher run directory."""
    run_dir = Path(run_dir)
    events = _jsonl(run_dir / "events.jsonl")
    t0 = next((e["time"] for e in events if e.get("event") == "launch"), None)
    steps = _jsonl(run_dir / "learner" / "metrics.jsonl")
    if t0 is None:
        t0 = steps[0]["time"] if steps else 0.0
    curve = Curve(
        label=label or run_dir.name,
        chance=next((e.get("chance", math.nan) for e in events if e.get("event") == "launch"), math.nan),
    )
    starts: dict[str, float] = {}
    for e in events:
        if e.get("event") == "stage":
            starts[e["stage"]] = (e["time"] - t0) / 60
    ordered = sorted(starts.items(), key=lambda kv: kv[1])
    for i, (stage, start) in enumerate(ordered):
        end = ordered[i + 1][1] if i + 1 < len(ordered) else math.nan
        curve.stages[stage] = (start, end)
    for line in steps:
        minutes = (line["time"] - t0) / 60
        if line.get("groups") and "reward_mean" in line:
            curve.reward_t.append(minutes)
            curve.reward.append(line["reward_mean"])
            curve.mismatch_kl.append(float(line.get("mismatch_kl_fresh", math.nan)))
            curve.behaviour_kl.append(float(line.get("mismatch_kl", math.nan)))
        if "eval/accuracy" in line:
            curve.eval_t.append(minutes)
            curve.eval_acc.append(line["eval/accuracy"])
            curve.eval_step.append(int(line.get("eval/round", -1)))
    return curve


def summarize(curve: Curve, outcome: str, target: float) -> dict:
    """The run's headline numbers (summary.json)."""
    evals = list(zip(curve.eval_t, curve.eval_step, curve.eval_acc))
    hit = next((t for t, _, acc in evals if acc >= target), None)
    kl = [k for k in curve.mismatch_kl if math.isfinite(k)]
    stale_kl = [k for k in curve.behaviour_kl if math.isfinite(k)]
    return {
        "outcome": outcome,
        "minutes": curve.reward_t[-1] if curve.reward_t else 0.0,
        "steps": len(curve.reward),
        "first_eval_accuracy": evals[0][2] if evals else None,
        "final_eval_accuracy": evals[-1][2] if evals else None,
        "best_eval_accuracy": max((a for *_, a in evals), default=None),
        "target": target,
        "minutes_to_target": hit,
        "evals": [{"minutes": round(t, 2), "step": s, "accuracy": a} for t, s, a in evals],
        "mismatch_kl": {
            **_mean_max(kl),
            "every_10_steps": [_finite(k, 6) for k in kl[::10]],
            "steps_measured": len(kl),
        },
        "behaviour_kl_with_staleness": _mean_max(stale_kl),
        "stages": {k: [_finite(v[0]), _finite(v[1])] for k, v in curve.stages.items()},
        "chance": _finite(curve.chance, 4),
    }


def _mean_max(values: list[float]) -> dict[str, float | None]:
    """Mean and maximum of finite values, rounded (None for an empty list)."""
    if not values:
        return {"mean": None, "max": None}
    return {"mean": _finite(sum(values) / len(values), 6), "max": _finite(max(values), 6)}


def _finite(value: float, digits: int = 2) -> float | None:
    """Rounded, or None for NaN/inf (JSON has no NaN): a stage still running has no end."""
    return round(value, digits) if math.isfinite(value) else None


def smooth(values: list[float], window: int = 10) -> list[float]:
    """Trailing moving average."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_runs(curves: list[Curve], out: str | Path, title: str = "Parallax CPU demo") -> Path:
    """Reward (smoothed) and held-out accuracy of each curve over minutes; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, c in enumerate(curves):
        colour = colours[i % len(colours)]
        if c.reward:
            ax.plot(
                c.reward_t,
                smooth(c.reward),
                color=colour,
                alpha=0.45,
                lw=1.2,
                label=f"{c.label}: training reward (10-step mean)",
            )
        if c.eval_acc:
            ax.plot(
                c.eval_t,
                c.eval_acc,
                color=colour,
                marker="o",
                ms=4,
                lw=2,
                label=f"{c.label}: held-out accuracy (greedy)",
            )
        warm = c.stages.get("warm-start")
        if warm and i == 0 and math.isfinite(warm[1]):
            ax.axvspan(warm[0], warm[1], color="grey", alpha=0.15, label="warm-start (format only)")
    chance = next((c.chance for c in curves if math.isfinite(c.chance)), math.nan)
    if math.isfinite(chance):
        ax.axhline(chance, color="black", ls=":", lw=1, label=f"chance ({chance:.2f})")
    ax.set_xlabel("minutes since launch (wall clock)")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="launcher run directories")
    parser.add_argument("--labels", nargs="*", default=None, help="one label per run")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--title", default="Parallax CPU demo")
    parser.add_argument("--summary", default=None, help="JSON to write: each run's summary by label")
    parser.add_argument("--target", type=float, default=0.8, help="accuracy whose first crossing is reported")
    args = parser.parse_args(argv)
    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error("give one label per run")
    curves = [run_curve(r, label) for r, label in zip(args.runs, labels)]
    print(plot_runs(curves, args.out, args.title))
    if args.summary:
        runs = {}
        for run, curve in zip(args.runs, curves):
            saved = Path(run) / "summary.json"
            outcome = json.loads(saved.read_text()).get("outcome", "") if saved.is_file() else ""
            runs[curve.label] = {"run_dir": str(run), **summarize(curve, outcome, args.target)}
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary).write_text(json.dumps(runs, indent=2) + "\n")
        print(args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
