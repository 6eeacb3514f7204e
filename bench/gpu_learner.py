"""Learner step on one GPU: packed + varlen attention + chunked logprobs vs the padded transformers baseline.

    python -m bench.gpu_learner                    # 7B then 3B on the H200, ~5 minutes
    python -m bench.gpu_learner --tiny             # CPU smoke test of the script (toy shapes)

Per model (random weights from the published Qwen2.5-VL-7B/3B configs, bf16 parameters, fused
AdamW with bf16 states, 16 samples of 96 text + 256 image (448x448) + 256-1024 response tokens),
on the same weights and the same samples, in this order:
  padded    transformers forward on right-padded (16, Lmax) batches with SDPA and an attention mask,
            full activation checkpointing, full-vocabulary logits of every position, fp32 log-softmax;
  packed-*  policy.forward.PackedPolicy on padding-free packs (policy.packing.pack) with varlen
            attention in the language model and the vision tower, logprob/entropy computed in
            1024-row chunks under checkpointing; "full" recomputes every block, "selective"
            keeps matmul/attention outputs (policy/recompute.py).
The loss is the learner's own (learner.losses.policy_loss, PPO-clip with decoupled correction).
Before timing, the packed and padded logprobs of the same tokens are compared (no grad).
One step = forward + backward of every micro-batch + optimizer step. Reported: tokens/s (all
prompt+image+response tokens), LM-MFU = 6 * N_LM * tokens / (seconds * 989 TFLOP/s) with N_LM the
language model's parameters without the input embedding (learner.metrics.lm_param_count), peak
memory, and each variant's speed-up over the padded baseline. Writes bench/results/gpu_learner.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.common import param_counts, preset_name
from policy.builder import build_model
from policy.presets import model_config
from policy.synthetic import padded_batch, synthetic_samples

PEAK_TFLOPS = 989.0
"""Dense bf16 peak of an H100/H200 SXM (the MFU denominator)."""

DEFAULT_VARIANTS = (
    "padded",
    "packed-full",
    "packed-selective",
    "packed-selective+dedup",
    "packed-selective+dedup+fuse",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["7b", "3b"], help="model sizes, in order")
    p.add_argument(
        "--variants",
        nargs="+",
        default=list(DEFAULT_VARIANTS),
        help="padded | packed-<ac> | fsdp-<ac>, ac = full | selective | selective:<k> | none; flags "
        "+dedup (one vision pass per group image), +vsel (selective AC in the vision tower), "
        "+fuse (torch.compile of the elementwise ops and logprob chunks), +cblocks (torch.compile "
        "of whole decoder blocks); suffix @<tokens> sets the micro-batch "
        "token budget (default 16384), *<n> the number of samples (default --samples)",
    )
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4, help="samples per prompt (they share its image)")
    p.add_argument("--profile", action="store_true", help="profile one extra step of every packed variant")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps per packed variant")
    p.add_argument("--baseline-steps", type=int, default=2, help="timed steps of the padded baseline")
    p.add_argument("--chunk", type=int, default=1024, help="rows per logprob chunk")
    p.add_argument("--tiny", action="store_true", help="toy shapes on CPU (checks the script, not the speed)")
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu_learner.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        args.models, args.samples = ["tiny"], 3
    report = {
        "command": "python -m bench.gpu_learner " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": machine(device),
        "models": {},
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    for size in args.models:
        report["models"][size] = run_model(size, args, device)
        write(report, args.out)
    print(format_table(report))
    write(report, args.out)
    return 0


def machine(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__}
    import transformers

    info["transformers"] = transformers.__version__
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return info


def write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def run_model(size: str, args: argparse.Namespace, device: torch.device) -> dict:
    config = model_config(preset_name(size))
    t0 = time.perf_counter()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_model(preset_name(size), device, dtype, seed=0).train()
    counts = param_counts(model)
    side = 112 if args.tiny else 448
    sets: dict[int, list] = {}

    def samples_of(n: int) -> list:
        if n not in sets:
            sets[n] = synthetic_samples(
                config,
                n=n,
                seed=1,
                image_side=side,
                group_size=args.group_size,
                response=(3, 12) if args.tiny else (256, 1024),
            )
        return sets[n]

    samples = samples_of(args.samples)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    out = {
        "params": counts,
        "tokens_per_step": tokens,
        "samples": len(samples),
        "build_s": round(time.perf_counter() - t0, 1),
        "variants": {},
    }
    print(
        f"[{size}] built in {out['build_s']} s: N_LM {counts['n_lm'] / 1e9:.2f} B, {tokens} tokens/step",
        flush=True,
    )
    out["numerics"] = guarded(lambda: compare_logprobs(model, config, samples, device, args.chunk))
    print(f"[{size}] packed vs padded logprobs: {out['numerics']}", flush=True)
    for variant in args.variants:
        n = guarded(lambda: {"n": parse_variant(variant)["samples"] or args.samples}).get("n", args.samples)
        batch = samples_of(n)
        res = guarded(lambda: run_variant(model, config, batch, variant, args, device))
        if "seconds" in res:
            res["samples"] = n
            res["tokens_per_step"] = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch)
            res.update(rates(res["seconds"], res["tokens_per_step"], counts["n_lm"]))
        out["variants"][variant] = res
        print(f"[{size}] {variant}: {summary(res)}", flush=True)
    base = out["variants"].get("padded", {}).get("tokens_per_s")
    for res in out["variants"].values():
        if base and "tokens_per_s" in res:
            res["speedup_vs_padded"] = round(res["tokens_per_s"] / base, 2)
    del model
    cleanup(device)
    return out


def guarded(fn) -> dict:
    """Run one measurement; an out-of-memory or other failure is recorded, not fatal."""
    try:
        return fn()
    except torch.OutOfMemoryError as e:
        return {"error": "out of memory", "detail": str(e).splitlines()[0][:200]}
    except Exception as e:  # report and go on with the next variant
        import traceback

        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        cleanup(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))


def cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def rates(seconds: list[float], tokens: int, n_lm: int) -> dict:
    step = statistics.median(seconds)
    tps = tokens / step
    return {
        "step_s": round(step, 3),
        "tokens_per_s": round(tps),
        "lm_mfu": round(6 * n_lm * tps / (PEAK_TFLOPS * 1e12), 4),
    }


def summary(res: dict) -> str:
    if "error" in res:
        return res["error"]
    if "tokens_per_s" in res:
        return (
            f"{res['tokens_per_s']} tok/s, LM-MFU {100 * res['lm_mfu']:.1f}%, step {res['step_s']} s, "
            f"peak {res.get('peak_gb', 0)} GB"
        )
    return json.dumps(res)


# ---------------------------------------------------------------------------------------------- steps
def use_sdpa(model) -> None:
    """Back to transformers' own SDPA attention everywhere (PackedPolicy switches it to varlen)."""
    for cfg in (
        model.config.text_config,
        model.model.language_model.config,
        model.config.vision_config,
        model.model.visual.config,
        model.config,
    ):
        cfg._attn_implementation = "sdpa"


def compare_logprobs(model, config, samples, device, chunk) -> dict:
    """Max/mean |packed - padded| of the response-token logprobs, same weights, no grad."""
    from policy.forward import PackedPolicy
    from policy.packing import pack

    model.eval()
    with torch.no_grad():
        use_sdpa(model)
        padded = padded_batch(samples, config, device)
        ref = padded_logprobs(model, padded)
        policy = PackedPolicy(model, chunk_size=chunk)
        got, _ = policy(pack(samples, config.image_token_id).to(device), with_entropy=False)
    model.train()
    diff = (got.float() - ref.float()).abs()
    return {
        "max_abs_diff": round(float(diff.max()), 4),
        "mean_abs_diff": round(float(diff.mean()), 5),
        "tokens": int(diff.numel()),
        "mean_logprob": round(float(ref.float().mean()), 3),
    }


def padded_logprobs(model, batch: dict) -> torch.Tensor:
    """Response-token logprobs of the padded batch in sample order (flattened), fp32."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"],
        use_cache=False,
    )
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    token = logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    return token[batch["response_mask"][:, 1:]]


def parse_variant(variant: str) -> dict:
    """ "<base>[+flag...][@tokens][*samples]" -> its parts; base padded | packed-<ac> | fsdp-<ac>."""
    rest, _, samples = variant.partition("*")
    rest, _, budget = rest.partition("@")
    base, *flags = rest.split("+")
    unknown = set(flags) - {"dedup", "vsel", "fuse", "cblocks"}
    if unknown or not (base == "padded" or base.startswith(("packed-", "fsdp-"))):
        raise ValueError(f"unknown variant {variant!r}")
    return {
        "base": base,
        "mode": base.partition("-")[2],
        "dedup": "dedup" in flags,
        "vision_selective": "vsel" in flags,
        "compile": "elementwise" if "fuse" in flags else "blocks" if "cblocks" in flags else "",
        "max_tokens": int(budget) if budget else 16384,
        "samples": int(samples) if samples else None,
    }


def run_variant(model, config, samples, variant: str, args, device) -> dict:
    """Warm up, then time `steps` optimizer steps of one variant; returns seconds per step and memory."""
    from policy.compile import apply_compile
    from policy.recompute import apply_recompute

    v = parse_variant(variant)
    mode = v["mode"]
    vision_mode = "none" if mode == "none" else "selective" if v["vision_selective"] else "full"
    if v["base"] == "padded":
        use_sdpa(model)
        apply_recompute(model, "full", "full")
        steps = args.baseline_steps
        inputs = [padded_batch(samples, config, device)]
        forward = _padded_forward(model)
    elif v["base"].startswith("packed-"):
        from policy.forward import PackedPolicy

        policy = PackedPolicy(model, chunk_size=args.chunk, compile_logprobs=v["compile"] == "elementwise")
        apply_recompute(model, mode, vision_mode)
        apply_compile(model, v["compile"])
        steps = args.steps
        inputs = packs(samples, config, v["max_tokens"], device, v["dedup"])
        forward = _packed_forward(policy)
    else:
        return run_fsdp(config, samples, v, vision_mode, args, device)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=1e-6,
        weight_decay=0.01,
        fused=device.type == "cuda",
        foreach=device.type != "cuda",
    )
    try:
        return timed(model, optimizer, forward, inputs, steps, args, device, v)
    finally:
        del optimizer
        model.zero_grad(set_to_none=True)
        uncompile(model)


def run_fsdp(config, samples, v: dict, vision_mode: str, args, device) -> dict:
    """The learner's own setup: fp32 master weights, FSDP2 bf16 mixed precision (one rank), its AdamW."""
    from learner.config import OptimConfig, ParallelConfig
    from learner.parallel import apply_parallelism, build_optimizer, init_distributed

    init_distributed()
    model = build_model(config, device, torch.float32, seed=0).train()
    pcfg = ParallelConfig(
        checkpoint_mode=v["mode"],
        vision_checkpoint_mode=vision_mode,
        compile=v["compile"],
        activation_checkpointing=v["mode"] != "none",
    )
    root = apply_parallelism(model, pcfg, device, chunk_size=args.chunk)
    optimizer, _ = build_optimizer(root, OptimConfig(lr=1e-6))
    inputs = packs(samples, config, v["max_tokens"], device, v["dedup"])
    try:
        return timed(root, optimizer, _packed_forward(root), inputs, args.steps, args, device, v)
    finally:
        del optimizer, root, model


def timed(model, optimizer, forward, inputs, steps, args, device, v: dict) -> dict:
    cleanup(device)
    times, opt_times = [], []
    for i in range(args.warmup + steps):
        step_s, opt_s = train_step(model, optimizer, forward, inputs, device)
        if i >= args.warmup:
            times.append(step_s)
            opt_times.append(opt_s)
    res = {
        "seconds": [round(t, 4) for t in times],
        "optimizer_s": round(statistics.median(opt_times), 4),
        "micro_batches": len(inputs),
        "max_tokens_per_microbatch": v["max_tokens"] if v["base"] != "padded" else None,
    }
    if v["base"] != "padded":
        res["vision_encodes"] = sum(
            int(x.image_grid_thw.shape[0]) for x in inputs if x.image_grid_thw is not None
        )
    if device.type == "cuda":
        res["peak_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 1)
        res["peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / 1e9, 1)
    if args.profile and device.type == "cuda":
        res["profile"] = profile_step(model, optimizer, forward, inputs, device)
    return res


def uncompile(model) -> None:
    """Back to eager modules (the next variant starts from the same model)."""
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
        module.__dict__.pop("forward", None)  # policy.compile's fused MLP forward


def profile_step(model, optimizer, forward, inputs, device, top: int = 25) -> dict:
    """One profiled step: GPU time by kernel class and the top CUDA kernels (what to attack next)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step_s, _ = train_step(model, optimizer, forward, inputs, device)
    kernels = sorted(
        (
            (e.key, e.self_device_time_total / 1e6, e.count)
            for e in prof.key_averages()
            if e.device_type.name == "CUDA" and e.self_device_time_total > 0
        ),
        key=lambda x: -x[1],
    )
    busy = sum(t for _, t, _ in kernels)
    classes: dict[str, float] = {}
    for name, t, _ in kernels:
        classes[kernel_class(name)] = classes.get(kernel_class(name), 0.0) + t
    return {
        "step_s": round(step_s, 3),
        "gpu_busy_s": round(busy, 3),
        "by_class_s": {k: round(t, 3) for k, t in sorted(classes.items(), key=lambda x: -x[1])},
        "top_kernels": [[name[:90], round(t, 4), n] for name, t, n in kernels[:top]],
    }


def kernel_class(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("gemm", "cutlass", "sm90_xmma", "cublas", "nvjet", "matmul")):
        return "matmul"
    if "flash" in low or "fmha" in low or "attn" in low:
        return "attention"
    if "triton" in low:
        return "triton (compiled)"
    if "nccl" in low:
        return "nccl"
    if "memcpy" in low or "memset" in low or "copy" in low:
        return "copy"
    if "reduce" in low or "softmax" in low or "norm" in low:
        return "reduction"
    return "elementwise/other"


def packs(samples, config, max_tokens: int, device, dedup: bool = False) -> list:
    """Token-budgeted packed micro-batches (the learner's first-fit-decreasing plan), on `device`.
    With `dedup`, a group's samples share a micro-batch and its image is encoded once (the learner's way)."""
    from learner.batching import plan_microbatches
    from policy.packing import pack

    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    groups = [s.image_keys[0] if s.image_keys else i for i, s in enumerate(samples)] if dedup else None
    return [
        pack([samples[i] for i in b], config.image_token_id, dedup_images=dedup).to(device)
        for b in plan_microbatches(lengths, max_tokens, groups)
    ]


def train_step(model, optimizer, forward, inputs, device) -> tuple[float, float]:
    """One optimizer step over all micro-batches; (step seconds, optimizer seconds)."""
    sync(device)
    t0 = time.perf_counter()
    n_total = sum(forward.count(x) for x in inputs)
    for x in inputs:
        loss = forward(x, n_total)
        loss.backward()
    sync(device)
    t1 = time.perf_counter()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    sync(device)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss(logprobs: torch.Tensor, seq_index: torch.Tensor, num_seqs: int, denom: float, entropy=None):
    """The learner's PPO-clip loss on these tokens with synthetic behaviour logprobs and advantages."""
    from learner.config import LossConfig
    from learner.losses import TokenBatch, policy_loss

    gen = torch.Generator(device="cpu").manual_seed(0)
    adv = (torch.randn(num_seqs, generator=gen)).to(logprobs.device)[seq_index]
    behaviour = logprobs.detach() + 0.01
    batch = TokenBatch(
        logprobs=logprobs,
        behaviour_logprobs=behaviour,
        advantages=adv,
        seq_index=seq_index,
        num_seqs=num_seqs,
        entropy=entropy,
    )
    loss, _ = policy_loss(LossConfig(), batch, denom)
    return loss


def _padded_forward(model):
    def forward(batch: dict, n_total: int) -> torch.Tensor:
        logprobs = padded_logprobs(model, batch)
        resp = batch["response_mask"][:, 1:]
        seq_index = torch.arange(resp.shape[0], device=resp.device).unsqueeze(1).expand_as(resp)[resp]
        return _loss(logprobs, seq_index, resp.shape[0], float(n_total))

    forward.count = lambda batch: int(batch["response_mask"].sum())
    return forward


def _packed_forward(policy):
    def forward(batch, n_total: int) -> torch.Tensor:
        logprobs, entropy = policy(batch, with_entropy=True)
        lens = torch.tensor(batch.response_lens, device=logprobs.device)
        seq_index = torch.repeat_interleave(
            torch.arange(len(batch.response_lens), device=logprobs.device), lens
        )
        return _loss(logprobs, seq_index, len(batch.response_lens), float(n_total), entropy)

    forward.count = lambda batch: int(batch.target_index.numel())
    return forward


def format_table(report: dict) -> str:
    lines = [
        f"{'model':<5} {'variant':<24} {'tok/s':>8} {'LM-MFU':>7} {'step s':>7} {'opt s':>6} {'peak GB':>8} "
        f"{'x padded':>8}"
    ]
    for size, m in report["models"].items():
        for variant, r in m["variants"].items():
            if "error" in r:
                lines.append(f"{size:<5} {variant:<24} {r['error']}")
                continue
            lines.append(
                f"{size:<5} {variant:<24} {r['tokens_per_s']:>8} {100 * r['lm_mfu']:>6.1f}% "
                f"{r['step_s']:>7.3f} {r['optimizer_s']:>6.3f} {r.get('peak_gb', 0):>8} "
                f"{r.get('speedup_vs_padded', ''):>8}"
            )
        lines.append(f"{size:<5} numerics (packed vs padded logprobs): {m.get('numerics')}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
