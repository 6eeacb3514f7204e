"""Learner step: the padded transformers baseline vs the learner's own train step, side by side.

    python -m bench.learner_step --device cpu                          # tiny model: checks the script
    python -m bench.learner_step --model 7b --reserve-frac 0.3         # one GPU (docs/benchmarks.md)

Each learner variant is `learner.trainer.Learner` itself, built from a LearnerConfig loaded from
`--config` (deploy/configs/learner.toml) with the variant's overrides, fed synthetic ScoredGroups
through its real `train_step` (advantages, staleness, packing, the no-grad passes the config asks
for, loss, clipping, the configured optimizer); only the broker (a ZeroMQ broker child process
holding the images) and the weight sender (none) are stand-ins. Every timed step gets fresh
groups (new images: their preprocessing is part of the step). The padded baseline is transformers'
own forward on right-padded batches (SDPA with a mask, full activation checkpointing, full-vocabulary
fp32 log-softmax), bf16 weights and a bf16 fused AdamW, with the learner's loss.

Workload (defaults = the reference's shapes): random weights with the published Qwen2.5-VL shapes,
groups of 5 samples sharing one 448x448 image, ~96 text + 256 image prompt tokens, 512-token
responses, 128 groups per train step (one of deploy/configs/learner.toml's mini-batches, so
`algo.mini_batches` = 1 here). Variants (VARIANTS, or NAME:key=value,key=value for more overrides):
  learner        the config as it is (with its proximal recompute pass and KL reference pass);
  learner-train  the same without the two no-grad passes (proximal detached, kl_coef 0): the
                 training pass alone, what LM-MFU targets count;
  fp32-master    learner-train with optim.master_weights = params (fp32 parameters under FSDP2:
                 the learner's path before learner/optim.py);
  device-master  learner-train with the fp32 master weights and moments on the GPU;
  learner-unshared, learner-train-unshared
                 learner and learner-train without batching.share_prompts (every sample packed
                 whole: the same samples trained on more computed tokens; the config shares each
                 group's prompt);
  learner-unjoined
                 learner with its no-grad pass over the training micro-batches themselves instead of
                 packs joined up to batching.no_grad_tokens_per_microbatch.
`--reserve-frac 0.3` first fills that share of the GPU (what a co-located vLLM generator takes), so
a variant that runs has fit next to one. Reported per variant: tokens/s (prompt + image + response
tokens trained), computed (the share of them its rows computed), LM-MFU = 6 x N_LM x computed
tokens/s / 989 TFLOP/s (N_LM: learner.metrics.lm_param_count; computed tokens are those trained
unless prompts are shared), pass MFU = the same over the learner's training pass alone (its
forwards and backwards, `train_pass_s`; the learner's variants), step seconds, the optimizer's and
no-grad passes' seconds, peak GPU
memory, host optimizer state, and the speed-up over padded. Prints a table; writes
bench/results/learner_step_<model>.json (learner_step_cpu.json on CPU).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import tyro

from bench import learner_workload as inputs
from bench.common import check_device, result_path, write_result
from bench.step_profile import profile_call

PEAK_TFLOPS = 989.0
"""Dense bf16 peak of an H100/H200 SXM (the LM-MFU denominator)."""

TRAIN_ONLY = ["algo.proximal=detached", "loss.kl_coef=0"]
VARIANTS = {
    "padded": None,
    "learner": [],
    "learner-train": TRAIN_ONLY,
    "fp32-master": [*TRAIN_ONLY, "optim.master_weights=params"],
    "device-master": [*TRAIN_ONLY, "optim.master_weights=device"],
    "learner-unshared": ["batching.share_prompts=false"],
    "learner-train-unshared": [*TRAIN_ONLY, "batching.share_prompts=false"],
    "learner-unjoined": ["batching.no_grad_tokens_per_microbatch=0"],
}
"""Variant name -> overrides of the loaded config (None: the padded transformers baseline)."""


@dataclass
class BenchConfig:
    """`python -m bench.learner_step`: padded baseline vs the learner's train step, in one run."""

    model: str = "7b"
    """Model shapes: 7b | 3b (published Qwen2.5-VL shapes, random weights) | tiny (toy widths)."""
    device: str = "cuda"
    """cuda or cpu (cpu: tiny shapes and small steps unless given; checks the script, not the speed)."""
    config: Path = Path("deploy/configs/learner.toml")
    """The learner config every learner variant starts from."""
    variants: tuple[str, ...] = ("learner-train", "padded", "learner", "fp32-master")
    """Variants in order (VARIANTS, or NAME:key=value,key=value)."""
    set: list[str] = field(default_factory=list)
    """Overrides for every learner variant, key=value (e.g. batching.max_tokens_per_microbatch=32768)."""
    groups: int = 128
    """Groups per timed train step (one optimizer step: algo.mini_batches is set to 1)."""
    group_size: int = 5
    """Samples per group (they share the group's image)."""
    response: int = 512
    """Response tokens per sample (all the same: forced lengths)."""
    text: int = 96
    """Text tokens per prompt (the image adds its own)."""
    image_side: int = 448
    """Image width and height in pixels (448 -> 256 image tokens)."""
    padded_groups: int = 16
    """Groups per step of the padded baseline (its tokens/s does not depend on the step size)."""
    warmup_groups: int = 8
    """Groups of each variant's untimed warm-up step (compilation, allocator)."""
    steps: int = 1
    """Timed train steps per variant."""
    reserve_frac: float = 0.0
    """Share of the GPU's memory held back for the whole run (a co-located generator's share)."""
    profile_groups: int = 0
    """After the timed steps, one more step of this many groups under torch.profiler (0: none): the row's
    `profile` says how much of it the GPU computed, how often the host waited for it, and the top
    kernels (bench/step_profile.py)."""
    out: Path | None = None
    """JSON path (default bench/results/learner_step_<model>.json, the model's "-" as "_";
    bench/results/learner_step_cpu.json on CPU)."""

    def resolve(self) -> BenchConfig:
        if self.device == "cpu" and self.model in ("7b", "3b"):
            return dataclasses.replace(
                self,
                model="tiny",
                groups=min(self.groups, 4),
                group_size=min(self.group_size, 3),
                response=min(self.response, 24),
                text=min(self.text, 24),
                image_side=min(self.image_side, 112),
                padded_groups=min(self.padded_groups, 2),
                warmup_groups=min(self.warmup_groups, 2),
            )
        return self


def variant_overrides(name: str) -> list[str] | None:
    base, _, extra = name.partition(":")
    if base not in VARIANTS:
        raise SystemExit(f"unknown variant {base!r}; choose from {sorted(VARIANTS)} (NAME:key=value,...)")
    if VARIANTS[base] is None:
        return None
    return [*VARIANTS[base], *filter(None, extra.split(","))]


def to_flags(overrides: list[str]) -> list[str]:
    """key=value overrides as the learner's command-line flags (runtime.config.load_config, tyro)."""
    flags = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"override {item!r} is not key=value")
        head, _, last = key.replace("_", "-").rpartition(".")
        prefix = "--" + (head + "." if head else "")
        if value.lower() in ("true", "false"):
            flags.append(prefix + ("" if value.lower() == "true" else "no-") + last)
        else:
            flags += [prefix + last, value]
    return flags


def learner_config(cfg: BenchConfig, overrides: list[str], model_dir: Path, broker_url: str, run_dir: Path):
    from learner.config import LearnerConfig
    from runtime.config import load_config

    fixed = [
        f"model={model_dir}",
        f"broker.url={broker_url}",
        f"run_dir={run_dir}",
        # per variant, so that each one starts from version 0
        f"broker.namespace=bench-{re.sub('[^a-z0-9]+', '-', run_dir.name.lower())}",
        "metrics.port=0",
        "weight_sync.enabled=false",
        "checkpoint.every=0",
        "checkpoint.resume=false",
        "eval.every=0",
        "eval.at_start=false",
        "feeder.train_data=",
        "feeder.test_data=",
        "algo.mini_batches=1",
        f"peak_tflops={PEAK_TFLOPS}",
    ]
    argv = ["--config", str(cfg.config), *to_flags([*fixed, *cfg.set, *overrides])]
    if cfg.device == "cpu":
        argv += ["--parallel.compile", ""]
    return load_config(LearnerConfig, argv)


def run_learner(cfg: BenchConfig, name: str, overrides, model_dir, transport, broker_url, work) -> dict:
    """One learner variant: a warm-up step, then `steps` timed train steps on fresh groups."""
    from learner.parallel import text_checkpoint_mode
    from learner.trainer import Learner
    from learner.wiring import NullSender

    lcfg = learner_config(cfg, overrides, model_dir, broker_url, work / name.replace(":", "_"))
    hold = inputs.reserve(cfg.device, cfg.reserve_frac)  # a co-located generator's share of the GPU
    learner = None
    try:
        learner = Learner(lcfg, transport=transport, sender=NullSender())
        timers = inputs.attach_timers(learner)
        make = inputs.GroupMaker(learner.images, learner.processor, cfg, seed=hash(name) % 1000)
        out = {
            "overrides": overrides,
            "master_weights": learner.master_weights,
            "param_dtype": str(learner.param_dtype).removeprefix("torch."),
            "max_tokens_per_microbatch": lcfg.batching.max_tokens_per_microbatch,
            "checkpoint_mode": text_checkpoint_mode(lcfg.parallel),  # what ran: "auto" runs selective here
            "compile": lcfg.parallel.compile,
        }
        learner.train_step(make.groups(cfg.warmup_groups, learner.version_now))
        rows, peaks = [], []
        for _ in range(cfg.steps):
            groups = make.groups(cfg.groups, learner.version_now)
            timers.clear()
            values = learner.train_step(groups)
            peaks.append(inputs.memory(learner.info.device))  # train_step restarts the peak every step
            if not values.get("tokens"):
                raise RuntimeError(
                    f"the step trained no tokens ({values.get('stale_samples', 0):.0f} stale samples)"
                )
            computed = values.get("computed_tokens", values["tokens"])
            rows.append(
                {
                    **timers.totals(),
                    "train_s": values["train_s"],
                    "train_pass_s": values.get("train_pass_s", 0.0),
                    "tokens": values["tokens"],
                    "computed_tokens": computed,
                }
            )
        out.update(inputs.summarise(rows, learner.n_lm_params, PEAK_TFLOPS))
        out.update(inputs.memory(learner.info.device, learner.optimizer))
        out.update(
            {key: max(p[key] for p in peaks) for key in (peaks[0] if peaks else ())}
        )  # timed steps' peaks
        if cfg.profile_groups > 0:
            groups = make.groups(cfg.profile_groups, learner.version_now)
            _, out["profile"] = profile_call(lambda: learner.train_step(groups), learner.info.device)
    finally:
        # rebinding (not del) frees them even while a traceback still holds this frame
        learner = timers = make = hold = None  # noqa: F841
        inputs.HOLD["bytes"] = 0
        inputs.cleanup()
    return out


def run_variant(cfg, name, model_dir, transport, broker_url, work) -> dict:
    overrides = variant_overrides(name)
    try:
        if overrides is None:
            result = inputs.run_padded(cfg, model_dir, transport, PEAK_TFLOPS)
            inputs.cleanup()
            return result
        return run_learner(cfg, name, overrides, model_dir, transport, broker_url, work)
    except torch.OutOfMemoryError as e:
        inputs.cleanup()
        return {"error": "out of memory", "detail": str(e).splitlines()[0][:300]}
    except Exception as e:  # a variant that fails is reported; the others still run
        import traceback

        traceback.print_exc()
        inputs.cleanup()
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def format_table(report: dict) -> str:
    w = max([34, *map(len, report["variants"])])
    head = (
        f"{'variant':<{w}} {'tok/s':>8} {'computed':>8} {'LM-MFU':>7} {'pass MFU':>8} {'step s':>7} "
        f"{'optim s':>7} {'no-grad s':>9} {'peak GB':>8} {'host GB':>8} {'x padded':>8}"
    )
    reserve = (
        f", {report['config']['reserve_frac']:.0%} of the GPU held back"
        if report["config"]["reserve_frac"]
        else ""
    )
    lines = [f"{report['model']}{reserve}", head, "-" * len(head)]
    for name, r in report["variants"].items():
        if "error" in r:
            lines.append(f"{name:<{w}} {r['error']}")
            continue
        computed = r.get("computed_tokens_per_step", 0) / max(r.get("tokens_per_step", 0), 1) or 1.0
        lines.append(
            f"{name:<{w}} {r['tokens_per_s']:>8.0f} {computed:>8.2f} {100 * r['lm_mfu']:>6.1f}% "
            f"{100 * r.get('pass_lm_mfu', 0):>7.1f}% "
            f"{r['step_s']:>7.2f} {r.get('optimizer_s', 0):>7.2f} {r.get('no_grad_s', 0):>9.2f} "
            f"{r.get('peak_gb', 0):>8.1f} {r.get('host_state_gb', 0):>8.1f} "
            f"{r.get('speedup_vs_padded', ''):>8}"
        )
    for name, r in report["variants"].items():
        if "profile" in r:
            p = r["profile"]
            lines.append(
                f"{name}: profiled step {p['wall_s']:.2f} s, GPU busy {p['gpu_busy_frac']:.0%}, "
                f"{p['host_syncs']} host syncs; top: " + ", ".join(t["name"][:40] for t in p["top"][:5])
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    cfg = tyro.cli(BenchConfig, args=argv, description=__doc__).resolve()
    check_device(cfg.device)
    for name in cfg.variants:  # bad names and overrides fail here, before anything is built
        overrides = variant_overrides(name)
        if overrides is not None:
            learner_config(cfg, overrides, Path("model"), "zmq://127.0.0.1:1", Path("check")).validate()
    out = cfg.out or result_path("learner_step", "cpu" if cfg.device == "cpu" else cfg.model)
    from broker.zmq_broker import BrokerProcess

    work = Path(tempfile.mkdtemp(prefix="parallax-learner-step-"))
    report = {
        "bench": "learner_step",
        "model": cfg.model,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(cfg).items()},
        "gpu_memory_gb": inputs.gpu_memory_gb(cfg.device),
        "variants": {},
    }
    t0 = time.perf_counter()
    model_dir = inputs.checkpoint(cfg.model, work / "model", cfg.device)
    report["build_s"] = round(time.perf_counter() - t0, 1)
    with BrokerProcess() as broker_proc:
        import broker

        transport = broker.connect(broker_proc.url)
        try:
            for name in cfg.variants:
                print(f"[{cfg.model}] {name} ...", flush=True)
                report["variants"][name] = run_variant(cfg, name, model_dir, transport, broker_proc.url, work)
                print(json.dumps(report["variants"][name]), flush=True)
                inputs.speedups(report["variants"])
                write_result(report, out)
        finally:
            transport.close()
            shutil.rmtree(work, ignore_errors=True)
    print(format_table(report))
    write_result(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
