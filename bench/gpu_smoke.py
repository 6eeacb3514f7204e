"""A short run of the whole pipeline on one GPU: learner, generator and reward service sharing the device.

    python -m bench.gpu_generator --smoke-steps 4      # (the usual way: reuses the bench's vLLM engine)
    python -m bench.gpu_smoke [--steps 4] [--tiny]     # standalone: builds its own engine first

Processes: a ZeroMQ broker; the reward service (reward_service.worker, one worker); the learner
(learner.trainer.Learner with its prompt feeder on the synthetic shapes task, FSDP2 over one rank =
bf16 compute with fp32 master weights, full activation checkpointing); the generator (this process:
generator.worker.GeneratorWorker on the given vLLM engine). Weights go learner -> generator through
the cuda-ipc transport (weights/ipc_*.py) on the GPU, or broadcast over gloo with --sync broadcast (the
only choice on CPU); with the engine core in its own process (the default on CUDA), an IPC version
reaches vLLM's worker as its reference and is loaded there from the learner's buffer. Random weights score 0 everywhere, so dynamic sampling is off (zero-advantage
groups still train: the run measures the mechanics, not learning). Reported per learner step from its
metrics.jsonl (tokens/s, MFU, sync seconds, wait for data), and per weight version on the generator
(apply seconds, time from the learner's announcement to serving it). Writes bench/results/gpu_smoke.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", default="main", choices=["main", "learner"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--sync", default="", help="cuda-ipc | broadcast (default: cuda-ipc on CUDA, broadcast on CPU)"
    )
    p.add_argument("--broker", default="")
    p.add_argument("--namespace", default="smoke")
    p.add_argument("--model", default="")
    p.add_argument("--task", default="")
    p.add_argument("--run-dir", default="/tmp/parallax-smoke/learner")
    p.add_argument("--groups", type=int, default=8, help="groups (prompts) per learner step")
    p.add_argument("--max-tokens", type=int, default=128, help="response length (forced: ignore_eos)")
    p.add_argument(
        "--mode",
        default="batch",
        choices=["batch", "drain", "inflight"],
        help="generator loop: batch, or continuous batching with new weights drained or in flight",
    )
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench/results/gpu_smoke.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.role == "learner":
        return learner_role(args)
    from bench.gpu_generator import Broker, build_engine, checkpoint
    from bench.gpu_generator import parse_args as gen_args

    gargs = gen_args(["--tiny"] if args.tiny else [])
    model_dir = checkpoint(gargs)
    with Broker() as url:
        import broker

        transport = broker.connect(url)
        engine = build_engine(model_dir, gargs)
        run_smoke(
            engine,
            transport,
            url,
            model_dir,
            steps=args.steps,
            out=args.out,
            tiny=args.tiny,
            sync=args.sync,
            mode=args.mode,
            max_tokens=args.max_tokens,
        )
    return 0


def run_smoke(
    engine,
    transport,
    url: str,
    model_dir: str,
    *,
    steps: int,
    out: Path,
    tiny: bool = False,
    sync: str = "",
    groups: int = 8,
    n: int = 4,
    max_tokens: int = 128,
    timeout_s: float = 240.0,
    mode: str = "batch",
) -> dict:
    """Run the pipeline for `steps` learner steps on `engine` (this process is the generator)."""
    from broker.names import Names
    from generator.config import SamplingConfig
    from tasks.synthetic import SyntheticConfig, write_task

    sync = sync or ("broadcast" if engine.on_cpu else "cuda-ipc")
    if tiny:
        groups, n, max_tokens = 2, 2, 8
    names = Names(f"smoke{int(time.time())}")
    work = Path("/tmp/parallax-smoke") / names.namespace
    task = work / "task"
    write_task(SyntheticConfig(out=task, train=groups * (steps + 3), test=2, image_size=56 if tiny else 448))
    engine.sampling = SamplingConfig(n=n, temperature=1.0, top_p=1.0, max_tokens=max_tokens)
    engine._train_params = engine._params(n, 1.0, 1.0)
    engine._train_params.ignore_eos = True
    loads = track_loads(engine)
    t0 = time.time()
    reward = start_reward(url, names.namespace, work)
    learner = start_learner(url, names.namespace, model_dir, task, steps, work, sync, groups, engine.on_cpu)
    worker = make_worker(engine, transport, names, sync, groups, mode)
    deadline = time.monotonic() + timeout_s

    def watch() -> (
        None
    ):  # a step may wait in the staleness gate for a version the finished learner never sends
        while learner.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        worker.stop()

    threading.Thread(target=watch, name="smoke-watch", daemon=True).start()
    try:
        while not worker._stop.is_set():
            worker.step()
        worker.sync_weights()
    finally:
        learner_rc = learner.poll()
        if learner_rc is None:
            learner.terminate()
        reward.terminate()
        for proc in (learner, reward):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if worker.receiver is not None:
            worker.receiver.close()
    report = summarise(
        work,
        names,
        transport,
        worker,
        loads,
        learner_rc,
        time.time() - t0,
        sync,
        steps,
        dict(groups=groups, n=n, max_tokens=max_tokens, mode=mode),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report), flush=True)
    return report


def track_loads(engine) -> list[dict]:
    """Record every weight application on the engine: version, seconds, wall time when served."""
    loads: list[dict] = []
    apply = engine.apply_weights

    def timed(named_tensors, version: int, running: bool = False) -> float:
        seconds = apply(named_tensors, version, running=running)
        loads.append(
            {
                "version": version,
                "apply_s": round(seconds, 4),
                "served_at": time.time(),
                "requests_running": running,
            }
        )
        return seconds

    engine.apply_weights = timed
    return loads


def _python(code_or_args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, *code_or_args],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=str(ROOT),
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )


def start_reward(url: str, namespace: str, work: Path) -> subprocess.Popen:
    code = (
        "from reward_service.config import RewardConfig; from reward_service.worker import run_worker; "
        f"run_worker(RewardConfig(broker={url!r}, namespace={namespace!r}, metrics_port=0, block_s=0.05))"
    )
    return _python(["-c", code], work / "reward.log")


def start_learner(url, namespace, model_dir, task, steps, work, sync, groups, on_cpu) -> subprocess.Popen:
    env = {}
    if not on_cpu:  # one FSDP2 rank: bf16 compute, fp32 master weights and optimizer state
        from broker.redis_server import free_port

        env = {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
        }
    args = [
        "-m",
        "bench.gpu_smoke",
        "--role",
        "learner",
        "--broker",
        url,
        "--namespace",
        namespace,
        "--model",
        model_dir,
        "--task",
        str(task),
        "--steps",
        str(steps),
        "--run-dir",
        str(work / "learner"),
        "--sync",
        sync,
        "--groups",
        str(groups),
    ]
    return _python(args, work / "learner.log", env)


def make_worker(engine, transport, names, sync: str, groups: int, mode: str = "batch"):
    """The generator as deployed: its receiver follows whichever weight sync the learner publishes;
    `mode` batch, or continuous batching with weight_update drain / inflight."""
    from generator.config import GeneratorConfig
    from generator.worker import GeneratorWorker

    cfg = GeneratorConfig(
        namespace=names.namespace,
        generator_id="gen-smoke",
        batch_prompts=groups,
        block_s=0.05,
        gate_poll_s=0.02,
        continuous=mode != "batch",
        weight_update="inflight" if mode == "inflight" else "drain",
    )
    return GeneratorWorker(cfg, engine=engine, transport=transport)


def learner_role(args) -> int:
    """The learner process: Learner + its feeder, with the chosen weight sender; exits without a final checkpoint."""
    import logging

    from learner.config import LearnerConfig
    from learner.trainer import Learner

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = LearnerConfig(
        model=args.model,
        broker=args.broker,
        namespace=args.namespace,
        run_dir=args.run_dir,
        max_steps=args.steps,
        idle_exit_s=120.0,
    )
    cfg.algo.groups_per_step, cfg.algo.max_staleness, cfg.algo.dynamic_sampling = args.groups, 1, False
    cfg.feeder.train_data = args.task
    cfg.checkpoint.every, cfg.checkpoint.resume, cfg.eval.every = 0, False, 0
    cfg.batching.max_tokens_per_microbatch = 16384
    cfg.weight_sync.transport = args.sync
    learner = Learner(cfg)
    learner.train()
    print(f"learner done: step {learner.state.step}, version {learner.state.version}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # no final checkpoint / HF export: this run measures steps, not persistence


def summarise(work: Path, names, transport, worker, loads, learner_rc, seconds, sync, steps, shape) -> dict:
    from broker import codec

    lines = []
    metrics = work / "learner" / "metrics.jsonl"
    if metrics.exists():
        lines = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    announced = {}
    raw = transport.get_value(names.learner_version)
    if raw:
        msg = codec.decode(raw)
        announced[msg.version] = msg.timestamp
    keys = (
        "step",
        "version",
        "tokens",
        "tokens_per_s",
        "mfu",
        "train_s",
        "sync_s",
        "wait_s",
        "samples",
        "response_len",
        "entropy",
        "mismatch_kl",
        "grad_norm",
        "staleness_mean",
        "staleness_max",
    )
    steps_out = [
        {k: round(v, 4) if isinstance(v, float) else v for k, v in line.items() if k in keys}
        for line in lines
    ]
    stamps = {int(line["version"]): line["time"] for line in lines}
    for load in loads:  # served time minus the learner's step-log time (written right after its sync)
        if load["version"] in stamps:
            load["served_after_log_s"] = round(load["served_at"] - stamps[load["version"]], 3)
    applies = sorted(load["apply_s"] for load in loads)
    return {
        "sync": sync,
        "steps_requested": steps,
        "learner_exit": learner_rc,
        "seconds": round(seconds, 1),
        "shape": shape,
        "learner_steps": steps_out,
        "generator": {
            "engine_core": "this process" if getattr(worker.engine, "in_process", True) else "own process",
            "groups_published": worker.published,
            "versions_applied": loads,
            "apply_s_median": applies[len(applies) // 2] if applies else None,
            "weight_failures": getattr(worker.engine, "weight_failures", 0),
            "inflight_updates": worker.metrics.value("parallax_generator_inflight_updates_total"),
            "receiver": receiver_stats(worker.receiver),
            "served_version": worker.engine.version,
        },
        "logs": {"learner": tail(work / "learner.log"), "reward": tail(work / "reward.log")},
    }


def receiver_stats(receiver) -> dict:
    stats = getattr(receiver, "stats", None)
    if stats is None:
        return {}
    return {
        k: getattr(stats, k)
        for k in ("joins", "versions", "failures", "apply_failures", "last_error")
        if hasattr(stats, k)
    }


def tail(path: Path, lines: int = 15) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []


def format_table(report: dict) -> str:
    out = [
        f"smoke run ({report['sync']} weight sync): {len(report['learner_steps'])} learner steps in "
        f"{report['seconds']} s, learner exit {report['learner_exit']}",
        f"{'step':>4} {'tokens':>7} {'tok/s':>8} {'MFU':>6} {'train s':>8} {'sync s':>7} {'wait s':>7}",
    ]
    for s in report["learner_steps"]:
        out.append(
            f"{int(s.get('step', 0)):>4} {int(s.get('tokens', 0)):>7} {s.get('tokens_per_s', 0):>8.0f} "
            f"{100 * s.get('mfu', 0):>5.1f}% {s.get('train_s', 0):>8.2f} {s.get('sync_s', 0):>7.3f} "
            f"{s.get('wait_s', 0):>7.2f}"
        )
    g = report["generator"]
    out.append(
        f"generator (engine core in {g['engine_core']}): {g['groups_published']} groups, serving version "
        f"{g['served_version']}; weight applies (version, s): "
        f"{[(v['version'], v['apply_s']) for v in g['versions_applied']]}, median {g['apply_s_median']}"
    )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
