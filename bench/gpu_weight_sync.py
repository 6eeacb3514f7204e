"""Weight sync learner -> generator on ONE GPU (two processes): CUDA IPC vs the bucketed gloo path.

    python -m bench.gpu_weight_sync                   # 7B, HF-model generator, ~2 minutes on the H200
    python -m bench.gpu_weight_sync --engine vllm     # the generator is Parallax's vLLM Engine (needs vLLM)
    python -m bench.gpu_weight_sync --tiny --paths gloo   # CPU smoke test of the script

The learner (this process) holds a random Qwen2.5-VL model (bf16, published 7B config) on the GPU;
a child process, the generator, holds its own copy: a transformers model loaded through
`generator.weight_receiver.module_loader` (`--engine hf`), or `generator.engine.Engine` (vLLM,
in-process, `apply_weights` = model.load_weights in place). Per sync, timed on the learner's clock:
  end-to-end   from the end of a (simulated) optimizer step -- every parameter changed in place and
               the stream synchronised -- until the generator reports that it serves the new version;
  learner      how long `sync()` blocks the learner.
Paths, side by side in the same run:
  ipc          policy/weight_ipc.py: pack into the shared buffer, the generator loads from it in place;
  gloo         learner/weight_sender.py -> generator/weight_receiver.py, CPU buckets over gloo (what two
               processes on one GPU get today: NCCL refuses two ranks on one device).
At the end the generator's weights are fingerprinted (fp64 sum per tensor) against the learner's.
Writes bench/results/gpu_weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import torch


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="7b", help="7b | 3b")
    p.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    p.add_argument("--paths", nargs="+", default=["ipc", "gloo"])
    p.add_argument("--syncs", type=int, default=10, help="timed IPC syncs")
    p.add_argument("--gloo-syncs", type=int, default=1)
    p.add_argument("--checkpoint-dir", default="/tmp/parallax-ckpt", help="where --engine vllm writes the model")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.tiny:
        args.model = "tiny"
    device = "cpu" if args.tiny else "cuda"
    out = args.out or Path(f"bench/results/gpu_weight_sync{'_vllm' if args.engine == 'vllm' else ''}.json")
    from bench.gpu_models import build_model, qwen_config, write_checkpoint

    config = qwen_config(args.model)
    ckpt = None
    if args.engine == "vllm":
        ckpt = str(write_checkpoint(config, Path(args.checkpoint_dir) / args.model, seed=0))
    model = build_model(config, device, torch.bfloat16 if device == "cuda" else torch.float32, seed=1)
    num_bytes = sum(p.numel() * 2 for p in model.parameters())
    report = {"command": "python -m bench.gpu_weight_sync " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": args.model, "engine": args.engine, "bytes_bf16": num_bytes, "paths": {},
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    for path in args.paths:
        report["paths"][path] = run_path(path, model, config, args, device, ckpt)
        print(f"{path}: {json.dumps(summary(report['paths'][path]))}", flush=True)
    print(format_table(report))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def run_path(path: str, model, config, args, device: str, ckpt: str | None) -> dict:
    from torch.distributed import TCPStore

    import datetime

    ctl = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=600), wait_for_workers=False)
    sender = make_sender(path, device)
    address = sender.start()
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=generator_main, args=(path, address, ctl.port, args.model, args.engine, ckpt, device),
                        daemon=True)
    child.start()
    try:
        ctl.wait(["ready"], datetime.timedelta(seconds=900))
        n = args.syncs if path == "ipc" else args.gloo_syncs
        warm = 1 if path == "ipc" else 0  # ipc: version 1 maps the buffer; gloo's group is built at join
        rows = [one_sync(sender, model, version, ctl) for version in range(1, n + warm + 1)]
        ctl.set("fingerprint?", "1")
        ctl.wait(["fingerprint"], datetime.timedelta(seconds=300))
        theirs = json.loads(ctl.get("fingerprint"))
        mine = fingerprint(model)
        mismatched = [k for k in mine if abs(mine[k] - theirs.get(k, float("nan"))) > 1e-6 * max(1.0, abs(mine[k]))]
    finally:
        ctl.set("stop", "1")
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        sender.close()
    timed = rows[warm:]
    e2e = [r["e2e_s"] for r in timed]
    return {"syncs": rows, "e2e_s_median": round(statistics.median(e2e), 4), "e2e_s_best": round(min(e2e), 4),
            "learner_s_median": round(statistics.median(r["learner_s"] for r in timed), 4),
            "apply_s_median": round(statistics.median(r["apply_s"] for r in timed), 4),
            "tensors_checked": len(mine), "tensors_mismatched": mismatched[:10],
            "weights_equal": not mismatched}


def make_sender(path: str, device: str):
    if path == "ipc":
        from policy.weight_ipc import IpcSenderConfig, IpcWeightSender

        return IpcWeightSender(IpcSenderConfig(dtype="bfloat16"))
    from learner.weight_sender import SenderConfig, WeightSender

    return WeightSender(SenderConfig(backend="gloo", timeout_s=300.0, keep_last=False, checksums=True,
                                     send_dtype="bfloat16"))


def one_sync(sender, model, version: int, ctl) -> dict:
    """Simulated optimizer step end (all parameters change in place), then sync; wait until served."""
    with torch.no_grad():
        params = [p for p in model.parameters()]
        torch._foreach_add_(params, 1e-3)
    if params[0].is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    report = sender.sync(model, version=version)
    t1 = time.perf_counter()
    key = f"served/{version}"
    while not ctl.check([key]):
        time.sleep(0.0002)
    t2 = time.perf_counter()
    apply_s = float(ctl.get(key))
    return {"version": version, "learner_s": round(t1 - t0, 4), "e2e_s": round(t2 - t0, 4),
            "apply_s": round(apply_s, 4), "bytes": report.num_bytes,
            "pack_s": round(getattr(report, "pack_seconds", 0.0), 4)}


def fingerprint(model) -> dict[str, float]:
    from policy.weight_transfer import checkpoint_names, named_tensors

    names = checkpoint_names(model)
    return {names[n]: float(t.detach().to(torch.bfloat16).double().sum()) for n, t in named_tensors(model)}


# ---------------------------------------------------------------------------------------------- child
def generator_main(path: str, address: str, ctl_port: int, size: str, engine_kind: str, ckpt: str | None,
                   device: str) -> None:
    """The generator process: an engine plus a receiver; applies each version and reports it served."""
    import datetime

    from torch.distributed import TCPStore

    ctl = TCPStore("127.0.0.1", ctl_port, None, False, datetime.timedelta(seconds=600), wait_for_workers=False)
    engine = make_engine(engine_kind, size, ckpt, device)
    receiver = make_receiver(path, address, device)
    ctl.set("ready", "1")
    while not ctl.check(["stop"]):
        received = receiver.take()
        if received is None:
            if ctl.check(["fingerprint?"]) and not ctl.check(["fingerprint"]):
                ctl.set("fingerprint", json.dumps(engine.fingerprint()))
            time.sleep(0.0005)
            continue
        t0 = time.perf_counter()
        engine.apply(received.named_tensors(), received.version)
        receiver.mark_served(received.version)
        ctl.set(f"served/{received.version}", str(time.perf_counter() - t0))
    receiver.close()


def make_receiver(path: str, address: str, device: str):
    if path == "ipc":
        from policy.weight_ipc import IpcWeightReceiver

        return IpcWeightReceiver("bench-gen", address, poll_s=0.0005)
    from generator.weight_receiver import ReceiverConfig, WeightReceiver

    return WeightReceiver(ReceiverConfig("bench-gen", address=address, device="cpu", timeout_s=300.0)).start()


class HFEngine:
    """A transformers model as the generator's weights (module_loader copies every tensor in place)."""

    def __init__(self, size: str, device: str):
        from bench.gpu_models import build_model, qwen_config
        from generator.weight_receiver import module_loader

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.model = build_model(qwen_config(size), device, dtype, seed=2)
        self._load = module_loader(self.model)

    def apply(self, pairs, version: int) -> None:
        self._load(((n, t.to(self.model.device, non_blocking=True)) for n, t in pairs), version)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def fingerprint(self) -> dict[str, float]:
        return fingerprint(self.model)


class VllmEngine:
    """Parallax's vLLM Engine (in-process); fingerprints read the served model inside the engine."""

    def __init__(self, ckpt: str):
        from generator.config import EngineConfig, SamplingConfig
        from generator.engine import Engine

        cfg = EngineConfig(enforce_eager=True, gpu_memory_utilization=0.35, keep_rollback_copy=False,
                           max_model_len=4096)
        self.engine = Engine(ckpt, cfg, SamplingConfig(), run_dir="/tmp/parallax-ws-run")

    def apply(self, pairs, version: int) -> None:
        self.engine.apply_weights(pairs, version)
        torch.cuda.synchronize()

    def fingerprint(self) -> dict[str, float]:
        return {"_note": 0.0}  # vLLM fuses qkv/gate_up: compared by generation in bench.gpu_smoke, not here


def make_engine(kind: str, size: str, ckpt: str | None, device: str):
    return VllmEngine(ckpt) if kind == "vllm" else HFEngine(size, device)


def summary(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "syncs"}


def format_table(report: dict) -> str:
    gb = report["bytes_bf16"] / 1e9
    lines = [f"weight sync {report['model']} ({gb:.1f} GB bf16), generator engine: {report['engine']}",
             f"{'path':<6} {'e2e median s':>13} {'e2e best s':>11} {'learner s':>10} {'apply s':>8} {'weights equal':>14}"]
    for path, r in report["paths"].items():
        lines.append(f"{path:<6} {r['e2e_s_median']:>13.4f} {r['e2e_s_best']:>11.4f} {r['learner_s_median']:>10.4f} "
                     f"{r['apply_s_median']:>8.4f} {str(r['weights_equal']):>14}")
    if {"ipc", "gloo"} <= set(report["paths"]):
        ratio = report["paths"]["gloo"]["e2e_s_median"] / report["paths"]["ipc"]["e2e_s_median"]
        lines.append(f"gloo / ipc end-to-end: {ratio:.1f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
