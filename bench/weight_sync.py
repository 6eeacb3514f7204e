"""Weight sync: Parallax's bucketed transfer vs the naive one-collective-per-parameter reference.

    python -m bench.weight_sync [--hidden 512] [--layers 20] [--bucket-mb 16 64 256] [--repeats 3]

A synthetic decoder-shaped model (per layer: q/k/v/o with biases, gate/up/down, two norms;
embeddings, final norm) is sent from this process (the learner) to one receiver process over
a loopback 2-rank gloo group, all paths side by side in the same run, interleaved:
  bucketed       learner/weight_sender.py -> generator/weight_receiver.py: manifest, packed
                 buckets, checksum trailer; the receiver verifies before the version counts.
                 With keep_last (the default) the learner packs every bucket into a kept copy
                 (for late joiners); without it, one-tensor buckets go out unpacked (no copy).
  per-parameter  the naive reference: one broadcast per tensor, each waited for, into a tensor
                 the receiver allocates for it (vLLM's examples/rl pattern), metadata known.
  per-param+rpc  the same with one metadata round trip per tensor first (name, dtype, shape
                 through the store), as naive schemes that announce each parameter do.
Per sync: `send_s` (the learner is blocked) and `e2e_s` (until the receiver has the whole
version: for bucketed, verified and acknowledged). Prints a table and writes
bench/results/weight_sync.json with the per-parameter/bucketed ratios.
GPU flags (`--backend nccl --device cuda`) need two GPUs (NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import tyro
from torch import nn

from generator.weight_receiver import ReceiverConfig, WeightReceiver
from learner.weight_sender import SenderConfig, WeightSender
from policy.weight_transfer import dtype_from_name, named_tensors, pair_group

NAIVE_SESSION = 1_000_000
"""Session number of the naive path's group (far from the sender's join tickets)."""


@dataclass
class BenchConfig:
    """`python -m bench.weight_sync`: bucketed vs per-parameter weight sync, side by side."""

    hidden: int = 512
    """Hidden size of the synthetic model (MLP is 2.75x, vocabulary 8x)."""
    layers: int = 20
    """Decoder layers of the synthetic model (hidden 512 x 20 layers is ~280 MB in fp32)."""
    dtype: str = "float32"
    """Parameter dtype."""
    bucket_mb: tuple[float, ...] = (16.0, 64.0, 256.0)
    """Bucket sizes to measure (MiB), each with keep_last; the last is also measured without it."""
    repeats: int = 3
    """Syncs per path and bucket size (interleaved); best and median are reported."""
    backend: str = "gloo"
    """"gloo" (CPU) or "nccl" (two GPUs)."""
    device: str = "cpu"
    """Learner-side tensor device; the receiver uses the next GPU with nccl."""
    out: Path = Path("bench/results/weight_sync.json")
    """Where the JSON results go."""


class SyntheticLM(nn.Module):
    """Parameters shaped like a decoder-only LM (Qwen2-style names), random values."""

    def __init__(self, hidden: int, layers: int, dtype: torch.dtype, device: str):
        super().__init__()

        def p(*shape):
            return nn.Parameter(torch.randn(*shape, device=device).to(dtype), requires_grad=False)

        ffn, vocab = int(hidden * 2.75), hidden * 8
        self.embed_tokens = p(vocab, hidden)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            layer = nn.Module()
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(layer, f"{name}_weight", p(hidden, hidden))
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(layer, f"{name}_bias", p(hidden))
            layer.gate_proj_weight, layer.up_proj_weight = p(ffn, hidden), p(ffn, hidden)
            layer.down_proj_weight = p(hidden, ffn)
            layer.input_layernorm, layer.post_attention_layernorm = p(hidden), p(hidden)
            self.layers.append(layer)
        self.norm = p(hidden)
        self.lm_head = p(vocab, hidden)


def _store(address: str, is_master: bool):
    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    return TCPStore(host, int(port), None, is_master, datetime.timedelta(seconds=300), wait_for_workers=False)


def bucketed_receiver(address: str, device: str) -> None:
    """Child process: receive versions into the mailbox and drop them (the engine's part is not measured)."""
    config = ReceiverConfig("bench", address=address, device=device, timeout_s=300.0)
    receiver = WeightReceiver(config).start()
    while True:
        receiver.take()
        time.sleep(0.001)


def naive_receiver(address: str, specs: list[tuple[str, list[int]]], device: str, backend: str) -> None:
    """Child process: per version, one broadcast per tensor into a tensor allocated for it, then "done".
    A version whose go-key says "rpc" first reads each tensor's metadata from the store."""
    store = _store(address, is_master=False)
    host = address.rpartition(":")[0]
    group = pair_group(backend, store, NAIVE_SESSION, 1, 300.0, host)
    version = 0
    while True:
        rpc = store.get(f"naive/go/{version}") == b"rpc"
        received = []
        for i, (dtype, shape) in enumerate(specs):
            if rpc:
                dtype, shape = json.loads(store.get(f"naive/meta/{version}/{i}"))
            t = torch.empty(shape, dtype=dtype_from_name(dtype), device=device)
            group.broadcast(t, 0).wait()
            received.append(t)  # the engine would load_weights([(name, t)]) here
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        store.set(f"naive/done/{version}", "1")
        version += 1


def _naive_sync(store, group, tensors, version: int, cuda: bool, rpc: bool) -> tuple[float, float]:
    t0 = time.perf_counter()
    store.set(f"naive/go/{version}", "rpc" if rpc else "1")
    for i, t in enumerate(tensors):
        if rpc:
            meta = [str(t.dtype).removeprefix("torch."), list(t.shape)]
            store.set(f"naive/meta/{version}/{i}", json.dumps(meta))
        group.broadcast(t, 0).wait()
    if cuda:
        torch.cuda.synchronize()
    sent = time.perf_counter() - t0
    store.wait([f"naive/done/{version}"])
    return sent, time.perf_counter() - t0


def _bucketed_sync(sender: WeightSender, model, version: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    report = sender.sync(model, version)
    sent = time.perf_counter() - t0
    while sender.members().get("bench", -1) != version:
        time.sleep(0.0005)
    if report.dropped:
        raise RuntimeError(f"receiver dropped during version {version}")
    return sent, time.perf_counter() - t0


def _row(key: tuple[str, float | None], runs: list[tuple[float, float]], num_bytes: int,
         tensors: int) -> dict:
    e2e = [r[1] for r in runs]
    best = min(e2e)
    return {
        "path": key[0], "bucket_mb": key[1], "tensors": tensors, "bytes": num_bytes,
        "send_s_best": min(r[0] for r in runs), "e2e_s_best": best, "e2e_s_median": statistics.median(e2e),
        "gb_per_s": num_bytes / best / 1e9, "runs": runs,
    }


def run(config: BenchConfig) -> dict:
    ctx = mp.get_context("spawn")
    model = SyntheticLM(config.hidden, config.layers, dtype_from_name(config.dtype), config.device)
    tensors = [t for _, t in named_tensors(model)]
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    remote = "cuda:1" if config.backend == "nccl" else "cpu"
    print(f"model: {len(tensors)} tensors, {num_bytes / 2**20:.0f} MiB; backend {config.backend}", flush=True)

    sender = WeightSender(SenderConfig(backend=config.backend, timeout_s=300.0))
    naive_store = _store("127.0.0.1:0", is_master=True)
    naive_address = f"127.0.0.1:{naive_store.port}"
    specs = [(str(t.dtype).removeprefix("torch."), list(t.shape)) for t in tensors]
    children = [
        ctx.Process(target=bucketed_receiver, args=(sender.start(), remote), daemon=True),
        ctx.Process(target=naive_receiver, args=(naive_address, specs, remote, config.backend), daemon=True),
    ]
    for p in children:
        p.start()
    try:
        naive_group = pair_group(config.backend, naive_store, NAIVE_SESSION, 0, 300.0, "127.0.0.1")
        while "bench" not in sender.members():
            time.sleep(0.01)
        keys = [("bucketed", mb) for mb in config.bucket_mb]
        keys += [("bucketed-nokeep", config.bucket_mb[-1]), ("per-parameter", None), ("per-param+rpc", None)]
        runs: dict[tuple, list] = {key: [] for key in keys}
        version, naive_version = 0, 0
        for _ in range(config.repeats):
            for key in keys:
                path, mb = key
                if path.startswith("bucketed"):
                    version += 1
                    sender.config.bucket_mb, sender.config.keep_last = mb, path == "bucketed"
                    runs[key].append(_bucketed_sync(sender, model, version))
                else:
                    cuda, rpc = remote != "cpu", path == "per-param+rpc"
                    runs[key].append(_naive_sync(naive_store, naive_group, tensors, naive_version, cuda, rpc))
                    naive_version += 1
                print(f"  {path:<16} {mb or '':>6}  e2e {runs[key][-1][1]:.3f} s", flush=True)
    finally:
        for p in children:
            p.kill()
            p.join()
        sender.close()
    rows = [_row(key, runs[key], num_bytes, len(tensors)) for key in keys]
    best = {(r["path"], r["bucket_mb"]): r["e2e_s_best"] for r in rows}
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                    "loadavg_1m": os.getloadavg()[0]},
        "results": rows,
        "ratios_e2e_best": {
            f"{naive} / {path} {mb:.0f} MiB": best[(naive, None)] / best[(path, mb)]
            for naive in ("per-parameter", "per-param+rpc") for (path, mb) in keys if mb is not None
        },
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def format_table(rows: list[dict]) -> str:
    lines = [f"{'path':<16} {'bucket MiB':>10} {'tensors':>8} {'MiB':>7} {'send s':>8} {'e2e s':>8} "
             f"{'median s':>9} {'GB/s':>6}"]
    for r in rows:
        mb = f"{r['bucket_mb']:.0f}" if r["bucket_mb"] else "-"
        lines.append(f"{r['path']:<16} {mb:>10} {r['tensors']:>8} {r['bytes'] / 2**20:>7.0f} "
                     f"{r['send_s_best']:>8.3f} {r['e2e_s_best']:>8.3f} {r['e2e_s_median']:>9.3f} "
                     f"{r['gb_per_s']:>6.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    config = tyro.cli(BenchConfig, args=sys.argv[1:] if argv is None else argv)
    report = run(config)
    print(format_table(report["results"]))
    for name, ratio in report["ratios_e2e_best"].items():
        print(f"{name}: {ratio:.2f}x")
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {config.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
