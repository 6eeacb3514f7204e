"""The learner's configuration: one `LearnerConfig` made of small per-component dataclasses.

Resolved by `runtime.config.load_config` (defaults < `--config file.toml` < CLI flags via tyro),
e.g. `python -m learner --model PATH --loss.policy.type gspo --algo.groups-per-step 16`.
Nothing here imports torch, so `python -m learner` can parse flags (and set
CUDA_VISIBLE_DEVICES) before torch is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal, get_args

from broker.config import BrokerConfig
from runtime.metrics import MetricsConfig
from runtime.variants import choices_shown, name_of
from weights.config import WeightSenderConfig

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Estimator = Literal["grpo", "drgrpo", "rloo"]
Proximal = Literal["detached", "recompute", "behaviour"]
POLICY_TYPES = choices_shown("ppo-clip", "gspo", "cispo", "sapo")
CORRECTION_TYPES = choices_shown("none", "decoupled", "tis", "icepop", "geo_mask")


@dataclass
class PpoClipLoss:
    """ppo-clip: max(-A·u, -A·clip(u, 1 - clip_low, 1 + clip_high)) on the token ratio u = π_θ/π_prox."""

    type: Annotated[Literal["ppo-clip"], POLICY_TYPES] = "ppo-clip"
    """The policy loss; each has its own parameters (`--help` after the type lists the chosen one's)."""
    clip_low: float = 0.2
    """The ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.3
    """The ratio is clipped above at 1 + clip_high (above clip_low: clip-higher)."""
    dual_clip: float = 3.0
    """For negative advantages the loss is capped at -A·dual_clip; <= 1 disables the cap."""

    def validate(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip_low and clip_high must be >= 0")


@dataclass
class GspoLoss:
    """gspo: PPO-clip on one ratio per sequence, exp of its mean token log-ratio; a whole sequence is
    clipped or not."""

    type: Annotated[Literal["gspo"], POLICY_TYPES] = "gspo"
    """The policy loss; each has its own parameters (`--help` after the type lists the chosen one's)."""
    clip_low: float = 3e-4
    """The sequence ratio is clipped below at 1 - clip_low."""
    clip_high: float = 4e-4
    """The sequence ratio is clipped above at 1 + clip_high."""
    dual_clip: float = 3.0
    """For negative advantages the loss is capped at -A·dual_clip; <= 1 disables the cap."""

    def validate(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip_low and clip_high must be >= 0")


@dataclass
class CispoLoss:
    """cispo: -A · sg(clip(u)) · log π_θ; the clip bounds each token's weight and drops no gradient."""

    type: Annotated[Literal["cispo"], POLICY_TYPES] = "cispo"
    """The policy loss; each has its own parameters (`--help` after the type lists the chosen one's)."""
    clip_low: float = 1.0
    """The stop-gradient weight is clipped below at 1 - clip_low (>= 1: no lower bound)."""
    clip_high: float = 3.0
    """The stop-gradient weight is clipped above at 1 + clip_high."""

    def validate(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip_low and clip_high must be >= 0")


@dataclass
class SapoLoss:
    """sapo: -A · (4/τ)·σ(τ(u-1)), a soft gate instead of a clip."""

    type: Annotated[Literal["sapo"], POLICY_TYPES] = "sapo"
    """The policy loss; each has its own parameters (`--help` after the type lists the chosen one's)."""
    tau_pos: float = 1.0
    """Temperature τ of the gate for tokens with a positive advantage."""
    tau_neg: float = 1.05
    """Temperature τ for the other tokens; larger shuts the gate faster as u moves away from 1."""

    def validate(self) -> None:
        if self.tau_pos <= 0 or self.tau_neg <= 0:
            raise ValueError("tau_pos and tau_neg must be > 0")


PolicyLoss = PpoClipLoss | GspoLoss | CispoLoss | SapoLoss


@dataclass
class NoCorrection:
    """none: every token has weight 1 (plain PPO on π_prox)."""

    type: Annotated[Literal["none"], CORRECTION_TYPES] = "none"
    """The off-policy correction of k = π_prox/μ; each has its own parameters (`--help` after the type lists
    the chosen one's)."""


@dataclass
class DecoupledCorrection:
    """decoupled: each token is weighted by k (decoupled PPO)."""

    type: Annotated[Literal["decoupled"], CORRECTION_TYPES] = "decoupled"
    """The off-policy correction of k = π_prox/μ; each has its own parameters (`--help` after the type lists
    the chosen one's)."""
    weight_cap: float = 0.0
    """Tokens whose k exceeds this get no loss; 0 keeps every token."""


@dataclass
class TisCorrection:
    """tis: each token is weighted by min(k, cap) (truncated importance sampling)."""

    type: Annotated[Literal["tis"], CORRECTION_TYPES] = "tis"
    """The off-policy correction of k = π_prox/μ; each has its own parameters (`--help` after the type lists
    the chosen one's)."""
    cap: float = 2.0
    """The largest weight a token gets."""


@dataclass
class IcepopCorrection:
    """icepop: each token is weighted by k, and tokens with k outside [low, high] get no loss."""

    type: Annotated[Literal["icepop"], CORRECTION_TYPES] = "icepop"
    """The off-policy correction of k = π_prox/μ; each has its own parameters (`--help` after the type lists
    the chosen one's)."""
    low: float = 0.5
    """Tokens with k below this get no loss."""
    high: float = 2.0
    """Tokens with k above this get no loss."""


@dataclass
class GeoMaskCorrection:
    """geo_mask: a sequence whose geometric-mean k is outside [low, high] gets no loss, the others
    weight 1."""

    type: Annotated[Literal["geo_mask"], CORRECTION_TYPES] = "geo_mask"
    """The off-policy correction of k = π_prox/μ; each has its own parameters (`--help` after the type lists
    the chosen one's)."""
    low: float = 0.99
    """Sequences whose geometric-mean k is below this get no loss."""
    high: float = 1.01
    """Sequences whose geometric-mean k is above this get no loss."""


Correction = NoCorrection | DecoupledCorrection | TisCorrection | IcepopCorrection | GeoMaskCorrection
POLICY_LOSSES: tuple[str, ...] = tuple(name_of(cls) for cls in get_args(PolicyLoss))
CORRECTIONS: tuple[str, ...] = tuple(name_of(cls) for cls in get_args(Correction))
POLICY_CORRECTIONS: dict[str, tuple[str, ...]] = {
    "ppo-clip": CORRECTIONS,
    "gspo": ("none", "geo_mask"),
    "cispo": ("none", "tis", "icepop", "geo_mask"),
    "sapo": CORRECTIONS,
}
"""The off-policy corrections each policy loss can be combined with (docs/algorithms.md, "Policy losses"):
GSPO's ratio is one per sequence, so only sequence-level rejection fits it (a per-token weight brings back the
token-level variance GSPO removes); CISPO's weight is a truncated importance weight, so decoupled's unbounded
k on top of it would undo the truncation (tis and icepop keep it bounded)."""


@dataclass
class LossConfig:
    """Policy loss, off-policy correction and regularisers (learner/losses.py)."""

    policy: PolicyLoss = field(default_factory=PpoClipLoss)
    """The policy-gradient surrogate on u = π_θ/π_prox and its parameters: `[loss.policy] type = "gspo"`,
    `--loss.policy.type gspo`."""
    correction: Correction = field(default_factory=DecoupledCorrection)
    """The off-policy correction of k = π_prox/μ and its parameters: `[loss.correction] type = "tis"`,
    `--loss.correction.type tis`. Which ones each policy loss takes: POLICY_CORRECTIONS."""
    aggregation: Aggregation = "token-mean"
    """How token losses become the batch loss; seq-mean-token-sum-norm is Dr.GRPO's constant normaliser."""
    norm_length: int = 1024
    """The constant length of seq-mean-token-sum-norm (Dr.GRPO: the maximum response length)."""
    kl_coef: float = 0.0
    """Weight of low_var_kl to the frozen reference policy (0 = no reference model is loaded)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""

    def validate(self) -> None:
        """The one place where a policy loss refuses a correction."""
        takes = POLICY_CORRECTIONS[self.policy.type]
        if self.correction.type not in takes:
            raise ValueError(
                f"policy={self.policy.type} cannot take correction={self.correction.type}; "
                f"it takes one of {takes} (why: learner/config.py POLICY_CORRECTIONS)"
            )


@dataclass
class AlgoConfig:
    """Advantages, batch composition and staleness."""

    estimator: Estimator = "grpo"
    """Group-relative advantage estimator (learner/advantages.py)."""
    adv_eps: float = 1e-6
    """ε added to the group std by grpo."""
    dynamic_sampling: bool = True
    """DAPO: drop groups whose rewards are all equal (counted), fill the step with others."""
    groups_per_step: int = 8
    """Rollout groups (prompts) that make one optimizer step, after dynamic sampling."""
    mini_batches: int = 1
    """Optimizer steps per batch of groups (PPO mini-batches); > 1 needs proximal=recompute."""
    max_staleness: int = 1
    """Samples whose version_start is more than this many versions behind the learner are dropped
    (counted)."""
    proximal: Proximal = "detached"
    """π_prox: detached (the step's own forward, exact when mini_batches == 1), recompute (extra
    no-grad forward before the step), behaviour (π_prox := μ, no correction possible)."""
    temperature: float = 1.0
    """Sampling temperature the generators used; logits are divided by it before log-softmax."""
    mask_truncated: bool = False
    """DAPO overlong filtering: samples the generator cut at max_tokens (finish reason "length") get no
    loss (counted as truncated_masked); without it they train like any sample on their (format-less)
    reward."""

    def validate(self) -> None:
        if self.groups_per_step < 1 or self.mini_batches < 1:
            raise ValueError("groups_per_step and mini_batches must be >= 1")
        if self.mini_batches > 1 and self.proximal == "detached":
            raise ValueError("mini_batches > 1 needs proximal = recompute (or behaviour)")


@dataclass
class OptimConfig:
    """AdamW and gradient clipping."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 1e-2
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Linear warm-up steps to the peak learning rate (then constant)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; <= 0 disables (the norm is still logged)."""
    master_weights: Literal["params", "device", "host", "auto"] = "params"
    """Where the fp32 master weights live (learner/optim.py). "params": the model's parameters are fp32 (on
    GPU, FSDP2 casts them to bf16 for compute; fp32 gradients and AdamW moments beside them: 16 bytes per
    parameter, sharded over the ranks). "device": bf16 parameters and gradients, the optimizer's fp32 master
    copy and moments on the GPU (16 bytes per parameter, one rank). "host": bf16 parameters and gradients on
    the GPU (4 bytes per parameter), fp32 master copy and moments in host memory (12 bytes per parameter),
    the update streamed in pinned chunks with both copy directions overlapping the CPU's AdamW (one rank:
    what lets a 7B learner share one GPU with its generator; a machine whose available host memory is smaller
    is refused by name before anything is allocated). "auto": host on one GPU, params otherwise."""
    host_threads: int = 0
    """master_weights = host: CPU threads of the update (0 = every CPU this process may use, whatever its
    own torch thread count: the update is memory-bound and runs while the GPU waits). `python -m deploy` sets
    it on a GPU layout to leave the roles it starts beside the learner their CPUs (deploy/plan.py: at 3B on
    an H100 machine, 8 of its 16 CPUs took 1.5 s a step beside vLLM, all 16 took 5.6 s)."""
    defer_update: bool = True
    """Where the KL reference pass already runs beside the host AdamW (master_weights = host on a GPU, with a
    KL term; one GPU; K > 0): hold a step's last AdamW back to the start of the next step, where it runs
    beside that step's first KL reference pass, and publish its weights as soon as it ends. Only when the
    next step's groups are all waiting when the learner asks for them (the learner bounds the pipeline);
    otherwise the update runs at once, alone, so the weights are never published later than without it. The
    same updates either way (tests/unit/learner/test_deferred_update.py)."""


@dataclass
class ParallelConfig:
    """FSDP2 sharding, precision and recomputation (learner/parallel.py)."""

    activation_checkpointing: bool = True
    """Recompute each decoder block's activations in the backward pass."""
    checkpoint_mode: Literal["full", "selective", "none", "auto"] = "full"
    """With activation_checkpointing, what the decoder blocks recompute in the backward pass: "full" (whole
    blocks), "selective" (only elementwise ops; the matmul and attention outputs are kept: fewer FLOPs, more
    memory), "none", or "auto": `python -m deploy` picks selective or full for its GPU layout; a learner
    started on its own runs selective."""
    selective_blocks: int = 0
    """With checkpoint_mode "selective": only the first this many decoder blocks run selective, the rest full
    (a knob to fit a memory budget); 0 = every block."""
    vision_checkpoint_mode: Literal["full", "selective", "none"] = "full"
    """The same choice for the vision tower's blocks ("full", "selective" or "none")."""
    compile: Literal["", "elementwise", "blocks"] = ""
    """torch.compile (policy/compile.py): "" none, "elementwise" (fused RMSNorms, SiLU x up and logprob
    chunks; matmuls stay eager, so selective checkpointing keeps its savings), "blocks" (whole decoder
    blocks; pair it with full checkpointing)."""
    mixed_precision: bool = True
    """bf16 parameters/compute with fp32 gradient reduction on GPU (CPU always runs fp32). On one GPU the
    learner still runs FSDP2 (a one-rank group) so that this applies."""
    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (ZeRO-3); False keeps them (ZeRO-2). Ignored on
    one rank (nothing to free: the gathered parameters are kept)."""
    backend: Literal["", "nccl", "gloo"] = ""
    """torch.distributed backend; empty = nccl on GPU, gloo on CPU."""
    reference_location: Literal["device", "host", "auto"] = "auto"
    """Where the KL term's frozen bf16 reference model lives (learner/reference.py): "device" (the GPU,
    sharded over the ranks), "host" (page-locked host memory, streamed to the GPU block by block in its
    forward: what lets a 7B learner share an 80 GB card with its vLLM) or "auto": the launcher's GPU layout
    picks host only where the learner does not fit otherwise (deploy/gpus/); a learner started on its own
    keeps it on the device. CPU runs ignore it."""

    def validate(self) -> None:
        if self.selective_blocks < 0:
            raise ValueError(f"selective_blocks must be >= 0, not {self.selective_blocks}")
        if self.selective_blocks and self.checkpoint_mode != "selective":
            raise ValueError(f"selective_blocks needs checkpoint_mode selective, not {self.checkpoint_mode}")


@dataclass
class BatchingConfig:
    """Packed micro-batches (learner/batching.py)."""

    max_tokens_per_microbatch: int = 8192
    """Token budget of one packed micro-batch (the tokens its row computes: prompt + image + response)."""
    share_prompts: bool = True
    """Put a group's prompt (text and image tokens) into a micro-batch's row once, each response attending
    to it (policy/packing.py), instead of once per response: the same logprobs and gradients for fewer
    tokens computed (with 5 responses of 512 tokens to a 352-token prompt, a third fewer). False packs
    every sample whole (the layout before shared prompts; tests compare the two)."""
    no_grad_tokens_per_microbatch: int = 0
    """Token budget of the no-grad passes' packs (the proximal recompute and the KL reference): consecutive
    training micro-batches are joined into packs of up to this many tokens. Those passes keep no activations,
    so packs several times the training budget fit, and fewer, bigger packs launch fewer kernels per token
    (a 3B learner at 16k-token packs is launch-bound on an H200: docs/benchmarks.md). The same logprobs
    either way. 0 = the training micro-batches themselves (as does any budget that no two of them fit)."""

    def validate(self) -> None:
        if self.max_tokens_per_microbatch < 1 or self.no_grad_tokens_per_microbatch < 0:
            raise ValueError("max_tokens_per_microbatch must be >= 1 and no_grad_tokens_per_microbatch >= 0")


@dataclass
class CheckpointConfig:
    """Periodic checkpoints and Hugging Face exports (learner/checkpoint.py)."""

    every: int = 50
    """Save every this many optimizer steps (0 = only at the end; -1 = never, nor a Hugging Face export at
    the end: benchmarks, whose consumed groups are then acked after every step). Acks wait for a checkpoint,
    so one is also made whenever half the scored stream's `max_len` awaits them (learner/trainer.py)."""
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
    """Prompts kept in flight (published, not yet back as scored groups); 0 = groups_per_step x
    (max_staleness + 1), the most for which the admission rule can bound staleness (more prompts in
    flight start on older weights)."""
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
    """Path of the Hugging Face checkpoint to train (e.g. built by policy.builder)."""
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
    """The broker. claim_idle_s: scored groups pending (unacked) this long are re-delivered; the learner acks
    only after a checkpoint, so keep it above the time between checkpoints (after a crash, what the dead
    learner held comes back after this long)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Prometheus server (rank 0 only; port 0 = none)."""
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

    def validate(self) -> None:
        """Rules across sections (each section checks its own fields)."""
        if self.loss.correction.type != "none" and self.algo.proximal == "behaviour":
            raise ValueError(
                f"loss.correction={self.loss.correction.type} needs a learner-side π_prox (algo.proximal)"
            )
