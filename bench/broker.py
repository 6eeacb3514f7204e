"""Broker throughput: rollout groups/s and MB/s through Redis Streams vs the ZeroMQ broker.

    python -m bench.broker [--groups 20000] [--batch 64]      (or ./run bench broker)

Realistic groups (8 samples x 512 tokens with behaviour logprobs, ~200 prompt tokens, one
reference to a ~100 KB PNG stored once in the blob store), a producer process and a consumer
process (which acks) on loopback, for both transports side by side, in two modes:
  bytes  pre-encoded payloads: the transport alone;
  typed  through broker.channel: msgspec encode in the producer, decode + type check in the consumer.
Prints a table and writes bench/results/broker.json, with the zmq/redis ratio of each mode and the
typed/bytes ratio of each transport (what encoding + decoding costs against the transport alone).
Runs a local redis-server and a ZeroMQ broker process on free ports and stops them afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from broker.demo import RunResult, format_table, image_png, run_pipeline
from broker.redis_server import LocalRedis
from broker.zmq_broker import BrokerProcess


@dataclass
class BenchConfig:
    """`python -m bench.broker`: throughput of both transports, side by side."""

    groups: int = 20_000
    """Rollout groups per run."""
    batch: int = 64
    """Groups per publish_many / consume call."""
    max_len: int = 1000
    """Stream bound (backpressure engages when the consumer falls this far behind)."""
    repeats: int = 2
    """Runs per (transport, mode), interleaved; the best is reported (this machine is shared)."""
    modes: tuple[str, ...] = ("bytes", "typed")
    out: Path = Path("bench/results/broker.json")
    """Where the JSON results go."""


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
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def main(argv: list[str] | None = None) -> int:
    config = tyro.cli(BenchConfig, args=sys.argv[1:] if argv is None else argv)
    report = run(config)
    best = [RunResult(**r) for r in report["results"]]
    print(format_table(best))
    for mode, ratio in report["ratio_zmq_over_redis"].items():
        print(f"zmq/redis ({mode}): {ratio:.2f}x")
    for label, ratio in report["ratio_typed_over_bytes"].items():
        print(f"typed/bytes ({label}): {ratio:.2f}x  (the reference: bytes, the transport alone)")
    config.out.parent.mkdir(parents=True, exist_ok=True)
    config.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {config.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
