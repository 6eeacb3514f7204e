"""`python -m learner --model PATH [--gpus 0-5 | --nproc N] [--config FILE.toml] [--flags ...]`

Parses the config and sets CUDA_VISIBLE_DEVICES before torch is imported; with several GPUs
(or `--nproc N` > 1 on CPU) it re-launches itself under `torch.distributed.run`, one process
per GPU (NCCL) or per CPU rank (gloo). The ranks get the resolved config through a JSON file
named by $PARALLAX_LEARNER_CONFIG (torchrun's own parser would swallow flags like --nproc); that
file has the broker password and the weight-sync token redacted, so they travel to them in
$PARALLAX_BROKER_PASSWORD and $PARALLAX_WEIGHT_SYNC_TOKEN.
A model path that is not a checkpoint directory is refused before anything starts, and so is a second
learner of a run (learner/fencing.py: rank 0 takes the run's lock file and broker lease first).
Each rank then runs `learner.entry.run(cfg)`.
"""

from __future__ import annotations

import json
import os
import sys

DESCRIPTION = """`python -m learner --model PATH [--gpus 0-5 | --nproc N] [--config FILE.toml] [--flags ...]`

Trains the policy on scored groups from the broker and sends its weights to the generators; one
process per GPU (or per --nproc CPU rank). Settings: the defaults, then --config FILE.toml, then
flags; every one is described in docs/configuration.md.
"""
"""What `--help` says above the flags (the module docstring is for readers of this file)."""

CONFIG_ENV = "PARALLAX_LEARNER_CONFIG"
TOKEN_ENV = "PARALLAX_WEIGHT_SYNC_TOKEN"


def world_size_wanted(gpus: list[int], nproc: int) -> int:
    """Number of ranks: one per listed GPU, else `nproc` CPU processes."""
    return len(gpus) if gpus else max(nproc, 1)


def relaunch_command(nproc: int) -> list[str]:
    """The torch.distributed.run command line that runs this module on `nproc` local ranks."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "learner",
    ]


def resolve(argv: list[str]):
    """The LearnerConfig of this process: from $PARALLAX_LEARNER_CONFIG in a re-launched rank, else flags."""
    from learner.config import LearnerConfig
    from runtime.config import from_dict, load_config

    path = os.environ.get(CONFIG_ENV)
    if path and "RANK" in os.environ:
        with open(path) as f:
            cfg = from_dict(LearnerConfig, json.load(f))
        if cfg.weight_sync.token:  # *** in the file
            cfg.weight_sync.token = os.environ.get(TOKEN_ENV, "")
        return cfg
    return load_config(LearnerConfig, argv, description=DESCRIPTION)


def main(argv: list[str] | None = None) -> None:
    from broker.config import PASSWORD_ENV
    from policy.model_dir import ModelDirError, model_dir
    from runtime.config import apply_gpus, write_resolved
    from runtime.private import private_umask

    private_umask()  # checkpoints, logs and configs: this user's only
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = resolve(argv)
    try:
        model_dir(cfg.model)
    except ModelDirError as exc:
        raise SystemExit(f"error: {exc}") from None
    gpus = apply_gpus(cfg.gpus)  # before torch is imported
    nproc = world_size_wanted(gpus, cfg.nproc)
    if nproc > 1 and "RANK" not in os.environ:
        password = cfg.broker.password()
        if password:  # the resolved config shows it as ***
            os.environ[PASSWORD_ENV] = password
        if cfg.weight_sync.token:  # likewise
            os.environ[TOKEN_ENV] = cfg.weight_sync.token
        os.environ[CONFIG_ENV] = str(write_resolved(cfg, cfg.run_dir, "learner").resolve())
        cmd = relaunch_command(nproc)
        os.execv(cmd[0], cmd)
    from learner.fencing import claim_run
    from runtime.redact import setup_logging

    setup_logging("INFO", "%(asctime)s %(name)s %(levelname)s %(message)s")  # the claim's lines too
    claim = claim_run(cfg) if os.environ.get("RANK", "0") == "0" else None  # before torch and the model
    from learner.entry import run

    run(cfg, claim)


if __name__ == "__main__":
    main()
