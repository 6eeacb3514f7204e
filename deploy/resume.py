"""Continuing a stopped run: `python -m deploy --resume RUN_DIR [flags]`.

A run directory holds everything a run needs to go on: `config.launcher.json` (the launcher's
config, read back here; flags given with --resume override it, e.g. a larger --max-minutes),
`run.json` (the run's broker namespace, so the roles find their streams again), the redis-server's
append-only file under `redis/` (every stream, consumer group, pending entry and value as of
the stop), the learner's checkpoints and the warm-started model. Resuming starts the broker on
that data, skips the stages already done (warm start) and starts the roles with their old
consumer names: the learner loads its last checkpoint and continues its data cursor, and every
entry that was in flight is re-read by the consumer that held it. The ZeroMQ broker keeps its
state in memory only, so a run on it cannot be resumed.
"""

from __future__ import annotations

import json
from pathlib import Path

RUN_FILE = "run.json"
"""The run's identity in its directory: {"run_id": ..., "namespace": ...}."""
CONFIG_FILE = "config.launcher.json"


def split_resume(argv: list[str]) -> tuple[Path | None, list[str]]:
    """(the directory given with --resume, the other arguments)."""
    out, resume = [], None
    args = iter(argv)
    for arg in args:
        if arg == "--resume":
            resume = next(args, None)
            if resume is None:
                raise SystemExit("--resume needs a run directory")
        elif arg.startswith("--resume="):
            resume = arg.split("=", 1)[1]
        else:
            out.append(arg)
    return (Path(resume).resolve() if resume else None), out


def resumed_config(run_dir: Path, argv: list[str], description: str | None = None):
    """The stopped run's LaunchConfig (run_dir pointing at it), with `argv` flags on top."""
    from deploy.plan import LaunchConfig
    from runtime.config import from_dict, load_config

    path = run_dir / CONFIG_FILE
    if not path.is_file() or not (run_dir / RUN_FILE).is_file():
        raise SystemExit(f"--resume {run_dir}: not a run directory (no {CONFIG_FILE} or {RUN_FILE})")
    saved = from_dict(LaunchConfig, json.loads(path.read_text()))
    cfg = load_config(LaunchConfig, argv, description=description, default=saved)
    cfg.run_dir = str(run_dir)
    if cfg.broker != "redis":
        raise SystemExit(
            f"--resume {run_dir}: the {cfg.broker} broker keeps no state on disk; only redis runs resume"
        )
    return cfg


def write_identity(run_dir: Path, run_id: str, namespace: str) -> None:
    (run_dir / RUN_FILE).write_text(json.dumps({"run_id": run_id, "namespace": namespace}, indent=2) + "\n")


def read_namespace(run_dir: Path) -> str:
    return json.loads((run_dir / RUN_FILE).read_text())["namespace"]
