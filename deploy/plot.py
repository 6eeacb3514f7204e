"""PNG plots of runs: training reward and held-out accuracy over wall-clock minutes.

`run_curve(run_dir)` reads a launcher run directory (events.jsonl for the launch time and the
stages, learner/metrics.jsonl for the per-step reward and the evaluations); `plot_runs` draws
one or more runs into one PNG (matplotlib, Agg backend: no display needed). The launcher writes
`<run_dir>/curve.png` at the end of every run; for several runs side by side (demo vs control):

    python -m deploy.plot runs/A runs/B --labels demo "control (shuffled images)" --out docs/demo_curve.png
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
        if "eval/accuracy" in line:
            curve.eval_t.append(minutes)
            curve.eval_acc.append(line["eval/accuracy"])
            curve.eval_step.append(int(line.get("eval/round", -1)))
    return curve


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
    args = parser.parse_args(argv)
    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error("give one label per run")
    print(plot_runs([run_curve(r, label) for r, label in zip(args.runs, labels)], args.out, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
