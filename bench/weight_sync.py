"""Weight sync: Parallax's bucketed transfer vs the naive one-collective-per-parameter reference.

    python -m bench.weight_sync [--hidden 512] [--layers 20] [--bucket-mb 16 64 256] [--repeats 3]

A synthetic decoder-shaped model (per layer: q/k/v/o with biases, gate/up/down, two norms;
embeddings, final norm) is sent from this process (the learner) to one receiver process over
a loopback 2-rank gloo group, all paths side by side in the same run, interleaved:
  bucketed       the `broadcast` transport (weights/broadcast_*.py): manifest, packed
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

import weights
from weights.config import WeightSyncConfig
from weights.interface import WeightSender
from weights.manifest import named_tensors
from weights.protocol import Announcement, decode, dtype_from_name, encode
from weights.rendezvous import pair_group

NAIVE_SESSION = 1_000_000
"""Session number of the naive path's group (far from the sender's join tickets)."""


@dataclass
class BenchConfig:
    """`python -m bench.weight_sync`: bucketed vs per-parameter weight sync, side by side."""

    hidden: int = 512
    """Hidden size of the synthetic model (hidden 512 x 20 layers is ~280 MB in fp32;
    Qwen2.5-7B's language model: --hidden 3584 --layers 28 --ffn 18944 --vocab 152064 --kv-dim 512)."""
    layers: int = 20
    """Decoder layers of the synthetic model."""
    ffn: int = 0
    """MLP width (0: 2.75 x hidden)."""
    vocab: int = 0
    """Vocabulary (0: 8 x hidden); embeddings and lm_head are untied."""
    kv_dim: int = 0
    """Output width of k_proj/v_proj (0: hidden; grouped-query attention makes it smaller)."""
    dtype: str = "float32"
    """Parameter dtype."""
    bucket_mb: tuple[float, ...] = (16.0, 64.0, 256.0)
    """Bucket sizes to measure (MiB), each with keep_last; the last is also measured without it."""
    paths: tuple[str, ...] = ("bucketed", "bucketed-nokeep", "per-parameter", "per-param+rpc")
    """Which paths to run."""
    repeats: int = 3
    """Syncs per path and bucket size (interleaved); best and median are reported."""
    backend: str = "gloo"
    """"gloo" (host buffers) or "nccl" (GPU buffers; a receiver on the same GPU gets CUDA IPC)."""
    device: str = "cpu"
    """Where the learner's model lives."""
    remote_device: str = "cpu"
    """Where the receiver puts what it receives ("cuda:0" with --backend nccl: same GPU, CUDA IPC;
    "cuda:1": NCCL between two GPUs)."""
    out: Path = Path("bench/results/weight_sync.json")
    """Where the JSON results go."""


class SyntheticLM(nn.Module):
    """Parameters shaped like a decoder-only LM (Qwen2-style names), random values."""

    def __init__(self, config: BenchConfig):
        super().__init__()
        dtype, device, hidden = dtype_from_name(config.dtype), config.device, config.hidden

        def p(*shape):
            return nn.Parameter(torch.randn(*shape, device=device, dtype=dtype), requires_grad=False)

        ffn, vocab, kv = config.ffn or int(hidden * 2.75), config.vocab or hidden * 8, config.kv_dim or hidden
        self.embed_tokens = p(vocab, hidden)
        self.layers = nn.ModuleList()
        for _ in range(config.layers):
            layer = nn.Module()
            layer.q_proj_weight, layer.o_proj_weight = p(hidden, hidden), p(hidden, hidden)
            layer.k_proj_weight, layer.v_proj_weight = p(kv, hidden), p(kv, hidden)
            layer.q_proj_bias, layer.k_proj_bias, layer.v_proj_bias = p(hidden), p(kv), p(kv)
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


def bucketed_receiver(announcement: bytes, device: str) -> None:
    """Child process: receive versions and drop them (the engine's part is not measured)."""
    a = decode(announcement, Announcement)
    config = WeightSyncConfig(address=a.address, token=a.token, timeout_s=300.0)
    receiver = weights.receiver(config, "bench", device=device).start()
    while True:
        received = receiver.poll()
        if received is not None:
            receiver.mark_served(received.version)
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


def _row(
    key: tuple[str, float | None], runs: list[tuple[float, float]], num_bytes: int, tensors: int
) -> dict:
    e2e = [r[1] for r in runs]
    best = min(e2e)
    return {
        "path": key[0],
        "bucket_mb": key[1],
        "tensors": tensors,
        "bytes": num_bytes,
        "send_s_best": min(r[0] for r in runs),
        "e2e_s_best": best,
        "e2e_s_median": statistics.median(e2e),
        "gb_per_s": num_bytes / best / 1e9,
        "runs": runs,
    }


def _keys(config: BenchConfig) -> list[tuple[str, float | None]]:
    keys = [("bucketed", mb) for mb in config.bucket_mb]
    keys += [("bucketed-nokeep", config.bucket_mb[-1]), ("per-parameter", None), ("per-param+rpc", None)]
    return [key for key in keys if key[0] in config.paths]


def run(config: BenchConfig) -> dict:
    ctx = mp.get_context("spawn")
    model = SyntheticLM(config)
    tensors = [t for _, t in named_tensors(model)]
    num_bytes = sum(t.numel() * t.element_size() for t in tensors)
    remote, keys = config.remote_device, _keys(config)
    naive = any(path.startswith("per-param") for path, _ in keys)
    print(f"model: {len(tensors)} tensors, {num_bytes / 2**20:.0f} MiB; backend {config.backend}", flush=True)

    device = "cuda" if config.backend == "nccl" else "cpu"
    sender = weights.sender(WeightSyncConfig(timeout_s=300.0, send_dtype="keep"), device=device)
    announcement = encode(sender.start())
    children = [ctx.Process(target=bucketed_receiver, args=(announcement, remote), daemon=True)]
    if naive:
        naive_store = _store("127.0.0.1:0", is_master=True)
        specs = [(str(t.dtype).removeprefix("torch."), list(t.shape)) for t in tensors]
        args = (f"127.0.0.1:{naive_store.port}", specs, remote, config.backend)
        children.append(ctx.Process(target=naive_receiver, args=args, daemon=True))
    for p in children:
        p.start()
    try:
        if naive:
            naive_group = pair_group(config.backend, naive_store, NAIVE_SESSION, 0, 300.0, "127.0.0.1")
        while "bench" not in sender.members():
            time.sleep(0.01)
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
        "machine": _machine(),
        "results": rows,
        "ratios_e2e_best": {
            f"{ref} / {path} {mb:.0f} MiB": best[(ref, None)] / best[(path, mb)]
            for ref in ("per-parameter", "per-param+rpc")
            if (ref, None) in best
            for (path, mb) in keys
            if mb is not None
        },
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _machine() -> dict:
    info = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "loadavg_1m": os.getloadavg()[0],
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def format_table(rows: list[dict]) -> str:
    lines = [
        f"{'path':<16} {'bucket MiB':>10} {'tensors':>8} {'MiB':>7} {'send s':>8} {'e2e s':>8} "
        f"{'median s':>9} {'GB/s':>6}"
    ]
    for r in rows:
        mb = f"{r['bucket_mb']:.0f}" if r["bucket_mb"] else "-"
        lines.append(
            f"{r['path']:<16} {mb:>10} {r['tensors']:>8} {r['bytes'] / 2**20:>7.0f} "
            f"{r['send_s_best']:>8.3f} {r['e2e_s_best']:>8.3f} {r['e2e_s_median']:>9.3f} "
            f"{r['gb_per_s']:>6.2f}"
        )
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
