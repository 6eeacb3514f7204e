"""Realistic rollout-group traffic through a transport, timed (`python -m broker demo`, bench/broker.py).

A group is what a generator publishes for one Geometry3k prompt: 8 samples x 512 response tokens
with per-token behaviour logprobs, ~200 prompt tokens, one reference to a ~100 KB PNG that is
stored once in the blob store. A producer process publishes `groups` of them (batched) and a
consumer process reads, decodes and acks them; throughput is groups (and payload MB) per second
from the producer's first publish to the consumer's last ack, and the CPU time per group of the
producer, the consumer and the broker process (which, unlike groups/s, does not depend on what
else the machine runs). Mode "typed" goes through
`broker.channel` (encode + decode included); mode "bytes" sends pre-encoded payloads, which
measures the transport alone.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import random
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import msgspec

from broker import codec, connect
from broker.images import ImageStore
from broker.names import Names
from broker.schemas import ImageRef, Rollout, RolloutGroup

POOL = 16
"""Distinct groups a producer cycles through (building random groups is not what we time)."""


def image_png(size: int = 180, seed: int = 0) -> bytes:
    """A noise PNG of about 100 KB (noise does not compress)."""
    from PIL import Image

    rng = random.Random(seed)
    image = Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def realistic_group(
    index: int, image: ImageRef, seed: int = 0, samples: int = 8, tokens: int = 512
) -> RolloutGroup:
    """One Geometry3k-like rollout group with random tokens (Qwen's vocabulary size) and logprobs."""
    rng = random.Random(seed * 1_000_003 + index)
    return RolloutGroup(
        group_id=f"g-{index}",
        prompt_id=f"p-{index}",
        data_source="geometry3k",
        prompt_token_ids=[rng.randrange(151_643) for _ in range(200)],
        images=[image],
        ground_truth="3\\sqrt{2}",
        samples=[
            Rollout.of(
                token_ids=[rng.randrange(151_643) for _ in range(tokens)],
                logprobs=[-rng.expovariate(2.0) for _ in range(tokens)],
                response_text="<think>" + "x" * 1200 + "</think> \\boxed{3\\sqrt{2}}",
                version_start=7,
                version_end=8,
                finish_reason="stop",
            )
            for _ in range(samples)
        ],
        generator_id="gen-0",
        timings={"queue": 0.01, "generate": 2.5},
    )


@dataclass
class RunResult:
    """Throughput of one producer -> consumer run."""

    transport: str
    mode: str
    groups: int
    seconds: float
    groups_per_s: float
    mb_per_s: float
    group_bytes: int
    producer_cpu_us: float
    """CPU time per group spent by the producer process (load-independent, unlike groups/s)."""
    consumer_cpu_us: float
    server_cpu_us: float | None
    """CPU time per group of the redis-server / zmq broker process (None when not ours to watch)."""


def _producer(url, stream, mode, groups, batch, max_len, image, start_q):
    transport = connect(url, max_len=max_len)
    pool = [realistic_group(i, image) for i in range(POOL)]
    payloads = [codec.encode(g) for g in pool]
    start_q.put(time.monotonic())
    cpu = time.process_time()
    for first in range(0, groups, batch):
        n = min(batch, groups - first)
        if mode == "typed":  # encode each group as a generator would
            msgs = [
                msgspec.structs.replace(pool[(first + i) % POOL], group_id=f"g-{first + i}") for i in range(n)
            ]
            batch_payloads = [codec.encode(m) for m in msgs]
        else:
            batch_payloads = [payloads[(first + i) % POOL] for i in range(n)]
        transport.publish_many(stream, batch_payloads, timeout=120)
    start_q.put(time.process_time() - cpu)
    transport.close()


def _consumer(url, stream, group, mode, groups, batch, ready, done_q):
    from broker.channel import Subscriber

    transport = connect(url)
    sub = Subscriber(transport, stream, group, "consumer-0", expect=RolloutGroup)
    ready.set()
    cpu = time.process_time()
    received, nbytes = 0, 0
    while received < groups:
        if mode == "typed":
            got = sub.poll(count=batch, block_s=1.0)
            sub.ack([d for d, _ in got])
            deliveries = [d for d, _ in got]
        else:
            deliveries = transport.consume(stream, group, "consumer-0", count=batch, block_s=1.0)
            transport.ack(stream, group, [d.id for d in deliveries])
        received += len(deliveries)
        nbytes += sum(len(d.payload) for d in deliveries)
    done_q.put((time.monotonic(), received, nbytes, time.process_time() - cpu))
    transport.close()


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_pipeline(
    url: str,
    label: str,
    mode: str,
    groups: int,
    batch: int = 64,
    max_len: int = 1000,
    server_pid: int | None = None,
) -> RunResult:
    """Time `groups` realistic groups from a producer process to a consumer process via `url`
    (`server_pid`: the broker's process, whose CPU time is reported too)."""
    names = Names(namespace=f"bench-{uuid.uuid4().hex[:8]}")
    with connect(url) as transport:
        image = ImageStore(transport, names).put(image_png())  # stored once, referenced by every group
    ctx = mp.get_context("spawn")
    ready, start_q, done_q = ctx.Event(), ctx.Queue(), ctx.Queue()
    consumer = ctx.Process(
        target=_consumer, args=(url, names.rollouts, Names.REWARD, mode, groups, batch, ready, done_q)
    )
    consumer.start()
    if not ready.wait(60):
        consumer.kill()
        raise RuntimeError("consumer process did not start")
    producer = ctx.Process(
        target=_producer, args=(url, names.rollouts, mode, groups, batch, max_len, image, start_q)
    )
    server_cpu = process_cpu_s(server_pid)
    producer.start()
    started = start_q.get(timeout=120)
    finished, received, nbytes, consumer_cpu = done_q.get(timeout=600)
    server_cpu = None if server_cpu is None else process_cpu_s(server_pid) - server_cpu
    producer_cpu = start_q.get(timeout=60)
    producer.join(30)
    consumer.join(30)
    seconds, per_group_us = finished - started, 1e6 / max(1, received)
    return RunResult(
        transport=label,
        mode=mode,
        groups=received,
        seconds=seconds,
        groups_per_s=received / seconds,
        mb_per_s=nbytes / seconds / 1e6,
        group_bytes=nbytes // max(1, received),
        producer_cpu_us=producer_cpu * per_group_us,
        consumer_cpu_us=consumer_cpu * per_group_us,
        server_cpu_us=None if server_cpu is None else server_cpu * per_group_us,
    )


def format_table(results: list[RunResult]) -> str:
    """Side-by-side text table of runs (CPU columns: microseconds of CPU per group)."""
    header = f"{'transport':<10} {'mode':<6} {'groups':>7} {'seconds':>8} {'groups/s':>9} {'MB/s':>7} " + (
        f"{'KB/group':>8} {'cpu us/group: producer':>22} {'consumer':>8} {'server':>7}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        server = "-" if r.server_cpu_us is None else f"{r.server_cpu_us:.0f}"
        lines.append(
            f"{r.transport:<10} {r.mode:<6} {r.groups:>7} {r.seconds:>8.2f} {r.groups_per_s:>9.0f} "
            f"{r.mb_per_s:>7.1f} {r.group_bytes / 1024:>8.1f} {r.producer_cpu_us:>22.0f} "
            f"{r.consumer_cpu_us:>8.0f} {server:>7}"
        )
    return "\n".join(lines)
