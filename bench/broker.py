"""Broker: rollout groups/s through Redis Streams vs the ZeroMQ broker, and image blob fetches.

    python -m bench.broker [--groups 20000] [--batch 64]      (or ./run bench broker)
    python -m bench.broker --mode blobs [--blobs 512]          # one request per blob vs get_blobs

`--mode stream` (default):

Realistic groups (8 samples x 512 tokens with behaviour logprobs, ~200 prompt tokens, one
reference to a ~100 KB PNG stored once in the blob store), a producer process and a consumer
process (which acks) on loopback, for both transports side by side, in two modes:
  bytes  pre-encoded payloads: the transport alone;
  typed  through broker.channel: msgspec encode in the producer, decode + type check in the consumer.
Prints a table and writes bench/results/broker.json, with the zmq/redis ratio of each mode and the
typed/bytes ratio of each transport (what encoding + decoding costs against the transport alone).
`--mode blobs`: P distinct 448x448 PNGs (bench.common.images) stored through broker.images.ImageStore,
read back on the same transport two ways, alternating after one warm-up each: one-by-one (`get_blob`
per image, the generator's loop before batching) and batched (`get_blobs`, broker.images.FETCH_CHUNK
keys per round trip: Redis MGET, one ZeroMQ request); writes bench/results/broker_blobs.json.
Runs a local redis-server and a ZeroMQ broker process on free ports and stops them afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

from bench.common import RESULTS, images, median, table, timed, write_result
from broker.demo import RunResult, format_table, image_png, run_pipeline
from broker.redis_server import LocalRedis
from broker.zmq_broker import BrokerProcess


@dataclass
class BenchConfig:
    """`python -m bench.broker`: both transports side by side (stream throughput or blob fetches)."""

    mode: Literal["stream", "blobs"] = "stream"
    """stream: rollout groups through the streams; blobs: image blob fetches for one batch."""
    groups: int = 20_000
    """Rollout groups per run."""
    batch: int = 64
    """Groups per publish_many / consume call."""
    max_len: int = 1000
    """Stream bound (backpressure engages when the consumer falls this far behind)."""
    repeats: int = 2
    """Runs per (transport, mode), interleaved; the best is reported (this machine is shared)."""
    modes: tuple[str, ...] = ("bytes", "typed")
    """stream: payload modes (bytes: the transport alone; typed: msgspec encode/decode too)."""
    blobs: int = 512
    """blobs: images per batch."""
    image_side: int = 448
    """blobs: images are image_side x image_side PNGs."""
    out: Path | None = None
    """Where the JSON result goes (default bench/results/broker.json, or broker_blobs.json)."""


def _best(runs: list[RunResult]) -> RunResult:
    return max(runs, key=lambda r: r.groups_per_s)


def run(config: BenchConfig) -> dict:
    runs: dict[tuple[str, str], list[RunResult]] = {}
    with LocalRedis() as redis_server, BrokerProcess() as zmq_broker:
        servers = {"redis": redis_server, "zmq": zmq_broker}
        for _ in range(config.repeats):
            for mode in config.modes:
                for label, server in servers.items():
                    result = run_pipeline(
                        server.url,
                        label,
                        mode,
                        config.groups,
                        config.batch,
                        config.max_len,
                        server.process.pid,
                    )
                    print(f"  {label:<5} {mode:<5} {result.groups_per_s:8.0f} groups/s", flush=True)
                    runs.setdefault((label, mode), []).append(result)
    best = [_best(rs) for rs in runs.values()]
    ratios = {
        mode: _best(runs[("zmq", mode)]).groups_per_s / _best(runs[("redis", mode)]).groups_per_s
        for mode in config.modes
    }
    typed_over_bytes = {
        label: _best(runs[(label, "typed")]).groups_per_s / _best(runs[(label, "bytes")]).groups_per_s
        for label in ("redis", "zmq")
        if (label, "typed") in runs and (label, "bytes") in runs
    }
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()},
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_1m": os.getloadavg()[0],
        },
        "image_bytes_stored_once": len(image_png()),
        "results": [dataclasses.asdict(r) for r in best],
        "all_runs": [dataclasses.asdict(r) for rs in runs.values() for r in rs],
        "ratio_zmq_over_redis": ratios,
        "ratio_typed_over_bytes": typed_over_bytes,
        "target_redis_groups_per_s": 5000,
    }


def measure_blobs(name: str, url: str, pngs: list[bytes], repeats: int) -> dict:
    """Store the images, then fetch them back both ways, alternating; medians and their ratio."""
    import broker
    from broker.images import FETCH_CHUNK, ImageStore
    from broker.names import Names

    transport = broker.connect(url)
    store = ImageStore(transport, Names(f"bench-blobs-{time.time_ns()}"))
    keys = [store.names.blob(store.put(png).sha256) for png in pngs]

    def one_by_one():
        return [transport.get_blob(key) for key in keys]

    def batched():
        return [
            b
            for at in range(0, len(keys), FETCH_CHUNK)
            for b in transport.get_blobs(keys[at : at + FETCH_CHUNK])
        ]

    ways = {"one_by_one": one_by_one, "batched": batched}
    for fetch in ways.values():
        if fetch() != pngs:  # warm-up, and both ways return the stored bytes in order
            raise RuntimeError(f"{name}: fetched blobs differ from the stored ones")
    times = {way: [] for way in ways}
    for _ in range(repeats):
        for way, fetch in ways.items():
            times[way] += timed(fetch, repeats=1, warmup=0)
    transport.close()
    med = {way: median(ts) for way, ts in times.items()}
    return {
        "broker": name,
        "blobs": len(keys),
        "one_by_one_s": round(med["one_by_one"], 4),
        "batched_s": round(med["batched"], 4),
        "batched_speedup": round(med["one_by_one"] / med["batched"], 2),
        "runs": times,
    }


def run_blobs(config: BenchConfig) -> dict:
    from broker.images import FETCH_CHUNK

    pngs = [png for png, _ in images(config.blobs, config.image_side)]
    rows = []
    with LocalRedis() as redis_server, BrokerProcess() as zmq_broker:
        for name, server in (("redis", redis_server), ("zmq", zmq_broker)):
            rows.append(measure_blobs(name, server.url, pngs, config.repeats))
    return {
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(config).items()},
        "fetch_chunk": FETCH_CHUNK,
        "mean_png_bytes": sum(map(len, pngs)) // len(pngs),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    config = tyro.cli(BenchConfig, args=sys.argv[1:] if argv is None else argv)
    if config.mode == "blobs":
        report = run_blobs(config)
        columns = ["broker", "blobs", "one_by_one_s", "batched_s", "batched_speedup"]
        print(
            table(
                "image blob fetches for one batch, median seconds (same transport, same blobs)",
                columns,
                report["rows"],
            )
        )
        write_result(report, config.out or RESULTS / "broker_blobs.json")
        return 0
    report = run(config)
    best = [RunResult(**r) for r in report["results"]]
    print(format_table(best))
    for mode, ratio in report["ratio_zmq_over_redis"].items():
        print(f"zmq/redis ({mode}): {ratio:.2f}x")
    for label, ratio in report["ratio_typed_over_bytes"].items():
        print(f"typed/bytes ({label}): {ratio:.2f}x  (the reference: bytes, the transport alone)")
    write_result(report, config.out or RESULTS / "broker.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
