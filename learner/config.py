"""The learner's configuration: one `LearnerConfig` made of small per-component dataclasses.

Resolved by `runtime.config.load_config` (defaults < `--config file.toml` < CLI flags via tyro),
e.g. `python -m learner --model PATH --loss.policy.type gspo --algo.groups-per-step 16`.
Nothing here imports torch, so `python -m learner` can parse flags (and set
CUDA_VISIBLE_DEVICES) before torch is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from broker.config import BrokerConfig
from learner.lora_config import LoraConfig
from learner.loss_config import LossConfig
from trackers.config import TrackedMetricsConfig
from weights.config import WeightSenderConfig

Estimator = Literal["grpo", "drgrpo", "rloo"]
Proximal = Literal["detached", "recompute", "behaviour"]


@dataclass
class AlgoConfig:
    """Advantages, batch composition and staleness."""

    estimator: Estimator = "grpo"
    """Group-relative advantage: grpo (r - mean) / (std + adv_eps), drgrpo r - mean, rloo r minus the mean
    of the group's other rewards."""
    adv_eps: float = 1e-6
    """ε added to the group's reward std by grpo."""
    dynamic_sampling: bool = True
    """DAPO: drop groups whose rewards are all equal (no signal; counted) and fill the step with others."""
    groups_per_step: int = 8
    """Rollout groups (prompts) that make one optimizer step, after dynamic sampling."""
    mini_batches: int = 1
    """Optimizer steps per batch of groups (PPO mini-batches); > 1 needs proximal=recompute."""
    max_staleness: int = 1
    """K: the most optimizer steps a sample's weights may lag the step that trains it; staler samples are
    dropped (counted). 0 = synchronous on-policy training; >= 1 lets generation run beside training."""
    proximal: Proximal = "detached"
    """π_prox: detached (the step's own forward, exact when mini_batches == 1), recompute (an extra no-grad
    forward before the step), behaviour (π_prox := μ; needs loss.correction none)."""
    temperature: float = 1.0
    """Sampling temperature the generators used; logits are divided by it before log-softmax."""
    mask_truncated: bool = False
    """DAPO overlong filtering: samples the generator cut at max_tokens get no loss (counted as
    truncated_masked); False trains them like any other sample, on their reward."""

    def validate(self) -> None:
        if self.groups_per_step < 1 or self.mini_batches < 1:
            raise ValueError("groups_per_step and mini_batches must be >= 1")
        if self.mini_batches > 1 and self.proximal == "detached":
            raise ValueError("mini_batches > 1 needs proximal = recompute (or behaviour)")


@dataclass
class OptimConfig:
    """AdamW and gradient clipping."""

    lr: float = 1e-6
    """Peak learning rate (reached after warmup_steps, then constant)."""
    weight_decay: float = 1e-2
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up to lr; 0 = lr from the first step."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; <= 0 = no clipping (the norm is still logged)."""
    master_weights: Literal["params", "device", "host", "auto"] = "params"
    """Where the fp32 master weights and AdamW moments live: "params" (fp32 parameters, sharded over the
    ranks), "device" (bf16 parameters, fp32 copy on the GPU; one rank), "host" (fp32 copy in host memory,
    12 bytes a parameter; one rank) or "auto" (host on one GPU, else params). Sizes: docs/memory.md."""
    host_threads: int = 0
    """With master_weights host: CPU threads of the AdamW update; 0 = every CPU this process may use.
    `python -m deploy` sets it to leave the roles beside the learner their CPUs (docs/gpu-layouts.md)."""
    defer_update: bool = True
    """With host AdamW on one GPU and a KL term: run a step's AdamW beside the next step's KL reference
    pass when that step's groups already wait. The same updates, never published later (docs/memory.md)."""


@dataclass
class ParallelConfig:
    """FSDP2 sharding, precision and recomputation (learner/parallel.py)."""

    activation_checkpointing: bool = True
    """Recompute each decoder block's activations in the backward pass."""
    checkpoint_mode: Literal["full", "selective", "none", "auto"] = "full"
    """What activation checkpointing recomputes in the backward pass: "full" (whole decoder blocks),
    "selective" (elementwise ops only: fewer FLOPs, more memory), "none", or "auto" (`python -m deploy` picks
    full or selective for its GPU layout; a learner started on its own runs selective). docs/memory.md."""
    selective_blocks: int = 0
    """With checkpoint_mode selective: only the first this many decoder blocks run selective, the rest full
    (to fit a memory budget); 0 = every block."""
    vision_checkpoint_mode: Literal["full", "selective", "none"] = "full"
    """The same choice for the vision tower's blocks ("full", "selective" or "none")."""
    compile: Literal["", "elementwise", "blocks"] = ""
    """torch.compile: "" (none), "elementwise" (fused RMSNorms, SiLU x up and logprob chunks; matmuls stay
    eager, so selective checkpointing keeps its savings) or "blocks" (whole decoder blocks; use with full)."""
    mixed_precision: bool = True
    """On GPU (one or several): bf16 parameters and compute, fp32 gradient reduction. CPU always runs fp32."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (ZeRO-3); False keeps them (ZeRO-2, more memory).
    Ignored on one rank."""
    backend: Literal["", "nccl", "gloo"] = ""
    """torch.distributed backend; empty = nccl on GPU, gloo on CPU."""
    reference_location: Literal["device", "host", "auto"] = "auto"
    """Where the KL term's frozen bf16 reference model lives: "device" (sharded over the GPUs), "host"
    (page-locked host memory, streamed to the GPU block by block: slower, frees its GPU memory) or "auto"
    (`python -m deploy` picks host only where nothing else fits; on its own: device). Ignored on CPU."""

    def validate(self) -> None:
        if self.selective_blocks < 0:
            raise ValueError(f"selective_blocks must be >= 0, not {self.selective_blocks}")
        if self.selective_blocks and self.checkpoint_mode != "selective":
            raise ValueError(f"selective_blocks needs checkpoint_mode selective, not {self.checkpoint_mode}")


@dataclass
class BatchingConfig:
    """Packed micro-batches (learner/batching.py)."""

    max_tokens_per_microbatch: int = 8192
    """Token budget of one packed micro-batch (prompt, image and response tokens together)."""
    share_prompts: bool = True
    """Put a group's prompt into a packed row once, each response attending to it: the same logprobs and
    gradients for fewer tokens computed (docs/memory.md). False packs every sample whole."""
    no_grad_tokens_per_microbatch: int = 0
    """Token budget of the no-grad passes' packs (proximal recompute, KL reference), made by joining
    consecutive training micro-batches: fewer kernel launches, the same logprobs. 0 = no joining."""

    def validate(self) -> None:
        if self.max_tokens_per_microbatch < 1 or self.no_grad_tokens_per_microbatch < 0:
            raise ValueError("max_tokens_per_microbatch must be >= 1 and no_grad_tokens_per_microbatch >= 0")


@dataclass
class CheckpointConfig:
    """Periodic checkpoints and Hugging Face exports (learner/checkpoint.py)."""

    every: int = 50
    """Save every this many optimizer steps (0 = only at the end; -1 = never, nor an export at the end, and
    groups are acked after every step). Groups are acked only once checkpoints hold them, so a checkpoint is
    also made before unacked groups fill the scored stream's max_len."""
    keep: int = 2
    """Number of most recent checkpoints kept on disk."""
    export_hf_every: int = 0
    """Export a Hugging Face checkpoint every this many steps (0 = only at the end)."""
    resume: bool = True
    """Resume from the newest checkpoint in the run directory when there is one."""


@dataclass
class FeederConfig:
    """The prompt feeder: owns the data cursor and publishes PromptRecords (learner/feeder.py)."""

    train_data: str = ""
    """Prompt records of the training split (a file written by tasks/)."""
    test_data: str = ""
    """Prompt records of the test split, for periodic evaluation."""
    prompts_ahead: int = 0
    """Prompts in flight (published, not yet back as scored groups); 0 = groups_per_step x
    (max_staleness + 1), the most for which staleness stays bounded (more start on older weights)."""
    epochs: int = 1
    """Passes over the training prompts."""
    shuffle: bool = True
    """Shuffle the prompt order each epoch (seeded)."""


@dataclass
class EvalConfig:
    """Periodic evaluation on the test split through the generators."""

    every: int = 0
    """Evaluate every this many steps (0 = never)."""
    at_start: bool = False
    """Also evaluate before the first step (round 0: the starting policy's accuracy)."""
    max_prompts: int = 0
    """Evaluate on at most this many test prompts (0 = all)."""
    temperature: float = 0.0
    """Sampling temperature for evaluation (0 = greedy)."""
    timeout_s: float = 600.0
    """Give up waiting for evaluation results after this long (the missing ones are counted)."""
    stop_accuracy: float = 0.0
    """Stop training once an evaluation's held-out accuracy reaches this (0 = never); the run then ends as at
    max_steps (final checkpoint, export)."""


@dataclass
class LearnerConfig:
    """Everything `python -m learner` needs."""

    model: str = ""
    """Hugging Face checkpoint directory to train (`python -m policy build` makes a random-weight one)."""
    gpus: str = ""
    """GPUs to use, e.g. "0-5"; empty = CPU."""
    nproc: int = 1
    """Number of CPU processes (gloo) when no GPUs are given."""
    run_dir: str = "runs/learner"
    """Where metrics.jsonl, checkpoints and exports go."""
    seed: int = 0
    """Seed of data order and initialisation."""
    max_steps: int = 100
    """Stop after this many optimizer steps."""
    sync_every: int = 1
    """Broadcast weights to the generators every this many optimizer steps."""
    consumer: str = "learner-0"
    """Consumer name of the learner in the scored stream's consumer group."""
    idle_exit_s: float = 0.0
    """Stop when no scored group arrived for this long (0 = wait forever)."""
    peak_tflops: float = 0.0
    """Peak dense bf16 TFLOP/s of one device for MFU; 0 = guess from the GPU name (unknown on CPU)."""
    broker: BrokerConfig = field(default_factory=lambda: BrokerConfig(claim_idle_s=600.0, max_deliveries=20))
    """The broker. The learner acks scored groups only once checkpoints hold them: keep claim_idle_s above
    twice the time between checkpoints (a dead learner's groups are re-delivered after it)."""
    metrics: TrackedMetricsConfig = field(default_factory=TrackedMetricsConfig)
    """Prometheus metrics and the experiment trackers (TensorBoard, W&B), written by rank 0 only."""
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Advantages, batch composition, staleness."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Loss and off-policy correction."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """FSDP2 and precision."""
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    """Micro-batching."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing and export."""
    feeder: FeederConfig = field(default_factory=FeederConfig)
    """Prompt feeding."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic evaluation."""
    weight_sync: WeightSenderConfig = field(default_factory=WeightSenderConfig)
    """Weight sync to the generators (`[weight_sync]`, `--weight-sync.transport.type cuda-ipc`;
    weights/config.py)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA (`[lora]`, `--lora.rank 16`; learner/lora_config.py): rank 0 trains every weight."""

    def validate(self) -> None:
        """Rules across sections (each section checks its own fields)."""
        if self.loss.correction.type != "none" and self.algo.proximal == "behaviour":
            raise ValueError(
                f"loss.correction={self.loss.correction.type} needs a learner-side π_prox (algo.proximal)"
            )
