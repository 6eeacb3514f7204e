"""The role configs `python -m deploy` would give its processes, written for processes started elsewhere.

    python -m deploy.role_configs --run-dir /runs --model /runs/warmstart/model --task-dir /runs/data \\
        --broker-url redis://127.0.0.1:6379/0 [--namespace parallax] [any flag of python -m deploy]

writes RUN_DIR/configs/{learner,generator,reward}.toml (and RUN_DIR/config.launcher.json) from the same
launch config and the same function (deploy.plan.role_configs) as the launcher, for its CPU layout; each
role then runs `python -m <role> --config RUN_DIR/configs/<role>.toml`. deploy/docker-compose.yml's `cpu`
profile runs the CPU demo that way, one container per role: `--model` is the warm-started checkpoint its
`warmstart` service wrote, and the launcher's flags pass through (`--learner.optim.lr 1e-4`,
`--config deploy/configs/demo.toml`). GPU layouts are planned on the GPUs by `python -m deploy` itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deploy.plan import LaunchConfig, gpu_plan, role_configs, write_role_configs
from runtime.config import write_resolved


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m deploy.role_configs", add_help=False, allow_abbrev=False)
    p.add_argument("--task-dir", required=True, help="the training prompts (python -m tasks ... --out)")
    p.add_argument("--test-dir", default="", help="the held-out prompts (default: --task-dir)")
    p.add_argument("--broker-url", required=True, help="the broker every role connects to")
    p.add_argument("--namespace", default="parallax", help="the broker namespace of the run's streams")
    return p


def write(cfg: LaunchConfig, task_dir: Path, test_dir: Path | None, broker_url: str, namespace: str) -> dict:
    """RUN_DIR/configs/<role>.toml for `cfg` (its run_dir and model set); returns the paths."""
    if not cfg.run_dir or not cfg.model:
        raise ValueError("--run-dir and --model are required (the roles' run directory and checkpoint)")
    if cfg.learner.gpus or cfg.generator.gpus:
        raise ValueError("GPU layouts are planned on the GPUs: run python -m deploy there")
    run_dir = Path(cfg.run_dir)
    configs = role_configs(
        cfg,
        run_dir,
        Path(cfg.model),
        task_dir,
        broker_url,
        namespace,
        test_dir=test_dir,
        gpus=gpu_plan(cfg, []),
    )
    write_resolved(cfg, run_dir, "launcher")
    return write_role_configs(configs, run_dir)


def main(argv: list[str] | None = None) -> int:
    from runtime.config import load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):  # its own options, then every flag of python -m deploy (tyro exits)
        parser().print_help()
        load_config(LaunchConfig, ["--help"], description=__doc__, prog="python -m deploy.role_configs")
    own, rest = parser().parse_known_args(argv)
    cfg = load_config(LaunchConfig, rest, description=__doc__, prog="python -m deploy.role_configs")
    try:
        paths = write(cfg, Path(own.task_dir), Path(own.test_dir) if own.test_dir else None,
                      own.broker_url, own.namespace)  # fmt: skip
    except ValueError as exc:
        print(f"python -m deploy.role_configs: {exc}", file=sys.stderr)
        return 2
    for path in paths.values():
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
