"""Join the runs of the comparison into one table with Parallax / peer ratios, and write the JSON.

    python -m bench.peers.report --parallax-k0 e2e_k0.json --parallax-k1 e2e_k1.json --trl trl.json \
        --verl verl.json --memory-dir MEM_DIR --out bench/results/peers_3b.json [--commit SHA] [--note TEXT]

Inputs: bench.e2e's result files (one K each), bench.peers.trl_grpo's and bench.peers.verl_grpo's, and the
GPU memory records bench.peers.gpumem wrote around each run (MEM_DIR/<name>.json, name = parallax_k0,
parallax_k1, trl, verl). A missing or failed run keeps its row with the error; its ratios are left out.
Every row's throughput is counted the same way (bench/peers/workload.py): prompt + response tokens of the
samples trained, per second of a step, per GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROW_KEYS = ("step_s", "per_step_s", "steps", "tokens_per_step", "tokens_per_s_per_gpu", "gpus")
PARALLAX = ("parallax_k1", "parallax_k0")
PEERS = ("trl", "verl")


def parallax_row(path: Path | None, name: str) -> dict:
    """A row from one bench.e2e result file (its single K)."""
    if path is None or not path.is_file():
        return {"name": name, "system": "parallax", "error": f"no result file ({path})"}
    report = json.loads(path.read_text())
    r = report["results"][0]
    per_step = [x.get("step_s") for x in r.get("per_step", [])] if r.get("per_step") else None
    return {
        "name": name,
        "system": "parallax",
        "k": r.get("k"),
        "mps": r.get("mps"),
        "mps_generator_sms": r.get("mps_generator_sms"),
        "mps_generator_priority": r.get("mps_generator_priority"),
        "command": report.get("command"),
        "machine": report.get("machine"),
        "error": r.get("error"),
        "learner_gpu_peak_gb": r.get("learner_gpu_peak_gb"),
        "learner_train_s": r.get("train_s"),
        "learner_wait_s": r.get("wait_s"),
        "generate_s": r.get("generate_s"),
        "learner_pack_tokens": r.get("learner_pack_tokens"),
        "learner_checkpoint_mode": r.get("learner_checkpoint_mode"),
        "per_step_s": per_step,
        **{k: r.get(k) for k in ROW_KEYS if k != "per_step_s"},
    }


def peer_row(path: Path | None, name: str) -> dict:
    """A row from a peer's result file (bench.peers.trl_grpo / verl_grpo)."""
    if path is None or not path.is_file():
        return {"name": name, "system": name, "error": f"no result file ({path})"}
    r = json.loads(path.read_text())
    keep = ("system", "version", "command", "settings", "overrides", "error", "exit_status", "run_s")
    return {"name": name, **{k: r[k] for k in keep if k in r}, **{k: r.get(k) for k in ROW_KEYS}}


def with_memory(row: dict, memory_dir: Path | None) -> dict:
    """The row plus the GPU's peak memory in use during its run (bench.peers.gpumem)."""
    path = memory_dir / f"{row['name']}.json" if memory_dir else None
    if path is None or not path.is_file():
        return row | {"peak_gpu_used_gib": None}
    mem = json.loads(path.read_text())
    return row | {"peak_gpu_used_gib": mem.get("peak_used_gib"), "gpu": mem.get("gpu")}


def ratios(rows: list[dict]) -> dict[str, float]:
    """tokens/s/GPU of each Parallax row over each peer's, where both ran."""
    by_name = {r["name"]: r for r in rows if r.get("tokens_per_s_per_gpu") and not r.get("error")}
    out = {}
    for mine in PARALLAX:
        for peer in PEERS:
            if mine in by_name and peer in by_name:
                out[f"{mine}/{peer}"] = (
                    by_name[mine]["tokens_per_s_per_gpu"] / by_name[peer]["tokens_per_s_per_gpu"]
                )
    return out


def _num(row: dict, key: str, fmt: str) -> str:
    """A table cell: the value formatted, or "-" where the row has none."""
    value = row.get(key)
    return "-".rjust(len(format(0, fmt))) if value is None else format(value, fmt)


def format_table(rows: list[dict], ratio: dict[str, float]) -> str:
    """The rows as a fixed-width table, then the ratios."""
    head = f"{'system':<14}{'s/step':>9}{'tokens/step':>13}{'tokens/s/GPU':>14}{'peak GPU GiB':>14}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        note = (r.get("error") or "")[:60]
        lines.append(
            f"{r['name']:<14}{_num(r, 'step_s', '9.1f')}{_num(r, 'tokens_per_step', '13,.0f')}"
            f"{_num(r, 'tokens_per_s_per_gpu', '14,.0f')}{_num(r, 'peak_gpu_used_gib', '14.1f')}  {note}"
        )
    lines += [f"{k}: {v:.2f}x" for k, v in ratio.items()]
    return "\n".join(lines)


def build(args: argparse.Namespace) -> dict:
    """The report: provenance first (date, commit, GPU, the commands), then the rows and the ratios."""
    rows = [
        parallax_row(args.parallax_k1, "parallax_k1"),
        parallax_row(args.parallax_k0, "parallax_k0"),
        peer_row(args.trl, "trl"),
        peer_row(args.verl, "verl"),
    ]
    errors = dict(item.split("=", 1) for item in args.error)
    rows = [
        with_memory(r, args.memory_dir) | ({"error": errors[r["name"]]} if r["name"] in errors else {})
        for r in rows
    ]
    ratio = ratios(rows)
    return {
        "date": args.date or datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": args.commit,
        "gpu": next((r["gpu"] for r in rows if r.get("gpu")), None),
        "command": [*args.command, "python -m bench.peers.report " + " ".join(args.argv)],
        "bench": "peers",
        "workload": "bench/peers/workload.py",
        "note": args.note,
        "rows": rows,
        "ratios": ratio,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers.report", description=__doc__.split("\n")[0])
    p.add_argument("--parallax-k0", type=Path)
    p.add_argument("--parallax-k1", type=Path)
    p.add_argument("--trl", type=Path)
    p.add_argument("--verl", type=Path)
    p.add_argument("--memory-dir", type=Path)
    p.add_argument("--out", type=Path, default=Path("bench/results/peers_3b.json"))
    p.add_argument("--commit", default=None, help="the commit the runs ran at")
    p.add_argument("--date", default=None, help="when the runs ran (default: now)")
    p.add_argument("--note", default="")
    p.add_argument("--error", action="append", default=[], metavar="NAME=TEXT", help="why a row did not run")
    p.add_argument("--command", action="append", default=[], help="a command that made a row (repeat)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    report = build(args)
    print(format_table(report["rows"], report["ratios"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
