"""`python -m learner --model PATH [--gpus 0-5 | --nproc N] [--config FILE.toml] [--flags ...]`

Parses the config and sets CUDA_VISIBLE_DEVICES before torch is imported; with several GPUs
(or `--nproc N` > 1 on CPU) it re-launches itself under `torch.distributed.run`, one process
per GPU (NCCL) or per CPU rank (gloo). Each rank then runs `learner.trainer.run(cfg)`.
"""

from __future__ import annotations

import os
import sys


def world_size_wanted(gpus: list[int], nproc: int) -> int:
    """Number of ranks: one per listed GPU, else `nproc` CPU processes."""
    return len(gpus) if gpus else max(nproc, 1)


def relaunch_command(nproc: int, argv: list[str]) -> list[str]:
    """The torch.distributed.run command line that runs this module on `nproc` local ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "learner", *argv]


def main(argv: list[str] | None = None) -> None:
    from learner.config import LearnerConfig
    from runtime.config import apply_gpus, load_config

    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = load_config(LearnerConfig, argv, description=__doc__)
    gpus = apply_gpus(cfg.gpus)  # before torch is imported
    nproc = world_size_wanted(gpus, cfg.nproc)
    if nproc > 1 and "RANK" not in os.environ:
        cmd = relaunch_command(nproc, argv)
        os.execv(cmd[0], cmd)
    from learner.trainer import run

    run(cfg)


if __name__ == "__main__":
    main()
