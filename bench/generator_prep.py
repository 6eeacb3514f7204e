"""Generator batch preparation: serial in the loop thread vs a thread pool, same prompts, same broker.

    python -m bench.generator_prep                           # 64 and 512 prompts, serial vs 8 threads
    python -m bench.generator_prep --prompts 64 --repeats 1  # quick check

What runs: generator.worker.GeneratorWorker.step() on one batch of P prompt records (P distinct
side x side PNG images of a few random shapes, one per prompt; bench.gpu_generator.prompt_set),
read from a ZeroMQ broker in its own process (as deployed), with a fake engine that returns a canned
256-token completion per prompt at once (no PromptChecker, no vLLM). So the step is: poll the prompt
stream, PREPARE (fetch each image blob, verify its sha256, decode the PNG, render the chat-templated
prompt ids: generator/prepare.py), "generate", build and publish the RolloutGroups, ack.
  serial  prepare_threads=0: everything in the loop thread (the old loop's cost);
  pool    prepare_threads=N: blobs fetched in the loop thread, verify + decode on N threads (at most one
          per core: generator.prepare.make_pool) while the loop thread renders the prompts.
`prepare_s` is the worker's own measure (the groups' timings["images"]), `step_s` the whole step.
Modes alternate per repeat (after one warm-up batch each); the median is reported. With vLLM's engine
core in its own process the preparation is the loop's exposed CPU time per generate call (91.4% / 86.4%
of bare vLLM's tokens/s at 64 / 512 prompts on the H200 before the pool). The pool's speedup is bounded
by the cores: on a 2-core machine at most ~2x on the decode part. Writes bench/results/generator_prep.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", nargs="+", type=int, default=[64, 512])
    p.add_argument("--threads", type=int, default=8, help="prepare_threads of the pool mode")
    p.add_argument("--image-side", type=int, default=448)
    p.add_argument("--max-tokens", type=int, default=256, help="length of the canned completions")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench/results/generator_prep.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from bench.gpu_generator import Broker, prompt_set
    from generator.prepare import usable_cpus

    engine = FakeEngine(tokenizer(), args.max_tokens)
    cpus = usable_cpus()
    report = {
        "bench": "generator_prep",
        "command": " ".join(["python -m bench.generator_prep", *argv]),
        "machine": {"cpus": cpus, "platform": platform.platform(), "python": platform.python_version()},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "notes": notes(cpus, args.threads),
        "rows": [],
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    modes = {"serial": 0, "pool": args.threads}
    with Broker() as url:
        import broker

        transport = broker.connect(url)
        warm = prompt_set(engine, 8, args.image_side, seed=10_000)
        for threads in modes.values():
            one_batch(engine, transport, warm, threads, tag=f"warm{threads}")
        for count in args.prompts:
            prompts = prompt_set(engine, count, args.image_side, seed=count)
            runs = {mode: [] for mode in modes}
            for rep in range(args.repeats):
                for mode, threads in modes.items():
                    tag = f"{mode}{count}r{rep}"
                    runs[mode].append(one_batch(engine, transport, prompts, threads, tag=tag))
            row = summarize(count, runs)
            report["rows"].append(row)
            print(
                f"{count} prompts: serial {row['serial']['prepare_s']} s, "
                f"pool {row['pool']['prepare_s']} s "
                f"({row['prepare_speedup']}x)",
                flush=True,
            )
        transport.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"wrote {args.out}")
    return 0


def notes(cpus: int, threads: int) -> str:
    bound = ""
    if cpus < threads:
        bound = (
            f"; prepare_threads={threads} is capped at this machine's {cpus} cores (more threads were "
            f"slower and noisier: generator/prepare.py), so the speedup is bounded by {cpus} cores"
        )
    return (
        "prepare_s = the worker's own timings['images'] (fetch + verify + decode + render), step_s = the "
        "whole step with an instant fake engine; medians over the repeats" + bound
    )


def tokenizer():
    """The tiny checkpoint's tokenizer (Qwen2.5-VL's chat template and vocabulary; built once, cached)."""
    from policy.builder import build_checkpoint
    from policy.loading import load_processor

    return load_processor(build_checkpoint("tiny", seed=0)).tokenizer


class FakeEngine:
    """What the worker needs of an engine; generate returns canned completions at once."""

    on_cpu = True
    in_process = True
    version = 0

    def __init__(self, tokenizer, max_tokens: int):
        from generator.inputs import Completion

        self.tokenizer = tokenizer
        self.completion = Completion(
            token_ids=[7] * max_tokens,
            logprobs=[-1.0] * max_tokens,
            text="x " * max_tokens,
            finish_reason="length",
        )
        self.last = []

    def generate(self, requests):
        from generator.inputs import Result

        self.last = requests
        return [
            Result(completions=[self.completion], version=0, prompt_len=len(r.prompt_token_ids))
            for r in requests
        ]

    def _reset_caches(self):
        pass

    def close(self):
        pass


def one_batch(engine, transport, prompts, threads: int, tag: str) -> dict:
    """One worker step on all `prompts` as one batch; prepare and step seconds, checked."""
    from bench.gpu_generator import worker_pass

    worker, step_s, groups = worker_pass(
        engine,
        transport,
        prompts,
        f"prep-{tag}",
        batch_prompts=len(prompts),
        block_s=1.0,
        prepare_threads=threads,
    )
    published = worker.published
    side = prompts[0].image.size
    checked = (
        published == len(groups) == len(prompts)
        and len(engine.last) == len(prompts)
        and all(r.images[0].size == side and r.images[0].mode == "RGB" for r in engine.last)
        and all(g.prompt_token_ids == p.ids for g, p in zip(groups, prompts))
    )
    threads_used = worker.pool._max_workers if worker.pool is not None else 0
    return {
        "prepare_s": groups[0].timings["images"] if groups else float("nan"),
        "step_s": step_s,
        "threads": threads_used,
        "checked": checked,
    }


def summarize(count: int, runs: dict[str, list[dict]]) -> dict:
    row = {"prompts": count}
    for mode, rs in runs.items():
        row[mode] = {
            "prepare_s": round(statistics.median(r["prepare_s"] for r in rs), 4),
            "step_s": round(statistics.median(r["step_s"] for r in rs), 4),
            "prepare_s_all": [round(r["prepare_s"], 4) for r in rs],
            "threads": rs[0]["threads"],
            "checked": all(r["checked"] for r in rs),
        }
    row["prepare_speedup"] = round(row["serial"]["prepare_s"] / row["pool"]["prepare_s"], 2)
    row["step_speedup"] = round(row["serial"]["step_s"] / row["pool"]["step_s"], 2)
    return row


def format_table(report: dict) -> str:
    threads = report["rows"][0]["pool"]["threads"] if report["rows"] else report["config"]["threads"]
    lines = [
        f"generator batch preparation, seconds per batch (median of {report['config']['repeats']}; "
        f"{report['machine']['cpus']} cores): serial vs a pool of {threads} threads "
        f"(prepare_threads={report['config']['threads']}, capped at the cores)",
        f"{'prompts':>8} {'serial prep':>12} {'pool prep':>10} {'speedup':>8} "
        f"{'serial step':>12} {'pool step':>10} {'speedup':>8} {'checked':>8}",
    ]
    for r in report["rows"]:
        s, p = r["serial"], r["pool"]
        lines.append(
            f"{r['prompts']:>8} {s['prepare_s']:>12.3f} {p['prepare_s']:>10.3f} "
            f"{r['prepare_speedup']:>7.2f}x "
            f"{s['step_s']:>12.3f} {p['step_s']:>10.3f} {r['step_speedup']:>7.2f}x "
            f"{str(s['checked'] and p['checked']):>8}"
        )
    lines.append("note: " + report["notes"])
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
