"""Image blob fetches for one generator batch: one request per blob vs `Transport.get_blobs` batches.

    python -m bench.blob_fetch                    # 512 blobs of 448x448 PNGs, Redis and ZeroMQ
    python -m bench.blob_fetch --blobs 64 --repeats 3

What runs: P distinct PNG images (bench.gpu_generator.prompt_set: a few random shapes per image, as
the generator benches use) are stored through broker.images.ImageStore, then read back the two ways
on the same transport, alternating, after one warm-up each:
  one-by-one  `get_blob` per image (the generator's loop before batching);
  batched     `get_blobs`, broker.images.FETCH_CHUNK keys per round trip (what ImageStore.open_many
              does now: Redis MGET, one ZeroMQ request).
Both brokers run as their own processes on this machine (redis-server; the ZeroMQ broker as
deployed), so the numbers are round trips on loopback plus copying the bytes. Prints a table
(median seconds per batch, ratio) and writes bench/results/blob_fetch.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blobs", type=int, default=512)
    p.add_argument("--image-side", type=int, default=448)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench/results/blob_fetch.json"))
    return p.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    pngs = images(args.blobs, args.image_side)
    rows = []
    for name, url_of in (("redis", redis_url), ("zmq", zmq_url)):
        with url_of() as url:
            rows.append(measure(name, url, pngs, args.repeats))
            print(format_table(rows), flush=True)
    import broker.images

    report = {
        "bench": "blob_fetch",
        "command": " ".join(["python -m bench.blob_fetch", *argv]),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        | {"fetch_chunk": broker.images.FETCH_CHUNK, "mean_png_bytes": sum(map(len, pngs)) // len(pngs)},
        "rows": rows,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def images(count: int, side: int) -> list[bytes]:
    from types import SimpleNamespace

    from bench.generator_prep import tokenizer
    from bench.gpu_generator import prompt_set

    return [p.png for p in prompt_set(SimpleNamespace(tokenizer=tokenizer()), count, side, seed=0)]


@contextlib.contextmanager
def redis_url():
    from broker.redis_server import LocalRedis

    server = LocalRedis().start()
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.contextmanager
def zmq_url():
    from bench.gpu_generator import Broker

    with Broker() as url:
        yield url


def measure(name: str, url: str, pngs: list[bytes], repeats: int) -> dict:
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

    times = {"one_by_one": [], "batched": []}
    for fetch in (one_by_one, batched):
        assert fetch() == pngs  # warm-up, and both ways return the stored bytes in order
    for _ in range(repeats):
        for mode, fetch in (("one_by_one", one_by_one), ("batched", batched)):
            t0 = time.perf_counter()
            fetch()
            times[mode].append(time.perf_counter() - t0)
    transport.close()
    med = {mode: statistics.median(ts) for mode, ts in times.items()}
    return {
        "broker": name,
        "blobs": len(keys),
        "one_by_one_s": round(med["one_by_one"], 4),
        "batched_s": round(med["batched"], 4),
        "speedup": round(med["one_by_one"] / med["batched"], 2),
        "runs": times,
    }


def format_table(rows: list[dict]) -> str:
    lines = [
        "image blob fetches for one batch, median seconds (same transport, same blobs)",
        f"{'broker':<7} {'blobs':>6} {'one-by-one s':>13} {'batched s':>10} {'speedup':>8}",
    ]
    for r in rows:
        lines.append(
            f"{r['broker']:<7} {r['blobs']:>6} {r['one_by_one_s']:>13.4f} {r['batched_s']:>10.4f} "
            f"{r['speedup']:>7.2f}x"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
