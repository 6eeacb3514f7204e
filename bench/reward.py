"""Reward scoring throughput: our worker path (grader process + hard timeout) vs mathruler in-process.

    python -m bench.reward [--groups 250] [--timeout-s 2]        (or ./run bench reward)

Workloads (seeded):
  typical       Geometry3k-style responses (a few hundred characters of reasoning, then \\boxed{}):
                integers, angles, decimals, square roots and fractions; right in the same form,
                right in an equivalent form (7.5 vs \\frac{15}{2}, 60^\\circ), wrong, or unboxed.
  pathological  the slow tail: megabyte responses, deep braces, LaTeX bombs, power towers,
                factorials (each answer once, against non-integer ground truths so sympy runs).
Paths, side by side on the same items:
  reference  EasyR1's reward code calling mathruler directly in this process (no timeout); on the
             pathological set each item runs in a throw-away subprocess killed after `ref_kill_s`,
             because in-process it would hang (or exhaust memory) for minutes.
  ours       `GroupScorer` over a `SafeGrader` (one grader process, per-answer timeout, groups of 8);
  ours+redis the whole worker in burst mode through a local redis-server (consume, score, publish once,
             ack; up to `groups_per_read` groups queued in the grader), typical workload only; its
             ratios to the reference are in "ratios" too;
  ours xN    `python -m reward_service --workers N --burst` (N processes, one consumer group), N x the
             typical groups, samples/s from the first scored group to the last (start-up excluded).
Reports samples/s (wall), samples per CPU-second (parent + grader: "per core"), per-sample latency
p50/p99, timeouts; prints a table and writes bench/results/reward.json.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import tyro

from bench.common import table, write_result
from bench.reward_workloads import GROUP, easyr1_score, pathological_items, typical_groups


@dataclass
class BenchConfig:
    """`python -m bench.reward`: scoring throughput, ours vs mathruler in-process."""

    groups: int = 250
    """Typical groups of 8 samples per run."""
    timeout_s: float = 2.0
    """Our per-answer hard timeout."""
    ref_kill_s: float = 10.0
    """Reference on the pathological set: each item's subprocess is killed after this long."""
    seed: int = 0
    redis: bool = True
    """Also run the worker end to end through a local redis-server."""
    scale_workers: tuple[int, ...] = (1, 2)
    """Worker counts for the multi-process run through redis (`python -m reward_service --workers N`)."""
    out: Path = Path("bench/results/reward.json")
    """Where the JSON results go."""


def _quantiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50_ms": pick(0.50) * 1e3, "p99_ms": pick(0.99) * 1e3, "max_ms": ordered[-1] * 1e3}


def _row(path: str, workload: str, n: int, wall: float, cpu: float, latencies: list[float], **extra) -> dict:
    return {
        "path": path,
        "workload": workload,
        "samples": n,
        "wall_s": wall,
        "cpu_s": cpu,
        "samples_per_s": n / wall,
        "samples_per_cpu_s": n / cpu if cpu else None,
        **_quantiles(latencies),
        **extra,
    }


def bench_reference_typical(groups) -> tuple[dict, list[tuple[float, float]]]:
    for truth, responses in groups[:5]:  # warm-up (imports, sympy caches of the parser)
        [easyr1_score(r, truth) for r in responses]
    latencies, results = [], []
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for truth, responses in groups:
        for response in responses:
            t = time.perf_counter()
            results.append(easyr1_score(response, truth))
            latencies.append(time.perf_counter() - t)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return _row("reference", "typical", len(results), wall, cpu, latencies), results


def _proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _make_group(gid: str, truth: str, responses: list[str]):
    from broker.schemas import Rollout, RolloutGroup

    samples = [
        Rollout.of(
            token_ids=[], logprobs=[], response_text=r, version_start=0, version_end=0, finish_reason="stop"
        )
        for r in responses
    ]
    return RolloutGroup(
        group_id=gid,
        prompt_id=gid,
        data_source="geometry3k",
        prompt_token_ids=[],
        images=[],
        ground_truth=truth,
        samples=samples,
    )


def bench_ours_typical(groups, timeout_s: float) -> tuple[dict, list[tuple[float, float]]]:
    from reward_service.pool import SafeGrader
    from reward_service.scoring import GroupScorer

    rollouts = [_make_group(f"g{i}", truth, responses) for i, (truth, responses) in enumerate(groups)]
    with SafeGrader(timeout_s=timeout_s, cache_size=0, spare=False) as grader:
        grader.start()
        scorer = GroupScorer(grader)
        for group in rollouts[:5]:
            scorer.score(group)
        pid = grader._active.proc.pid
        latencies, results = [], []
        wall0, cpu0, child0 = time.perf_counter(), time.process_time(), _proc_cpu_s(pid)
        for group in rollouts:
            items = [("math", s.response_text, group.ground_truth) for s in group.samples]
            outcomes = grader.grade(items)  # what GroupScorer.score does, keeping per-sample times
            latencies += [o.seconds for o in outcomes]
            results += [(o.accuracy, o.format) for o in outcomes]
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0 + _proc_cpu_s(pid) - child0
        timeouts = grader.timeouts
    return _row(
        "ours",
        "typical",
        len(results),
        wall,
        cpu,
        latencies,
        timeouts=timeouts,
        latency_note="per sample: grader answer to answer (first of a group includes the send)",
    ), results


def bench_ours_pathological(items, timeout_s: float) -> dict:
    from reward_service.pool import SafeGrader

    with SafeGrader(timeout_s=timeout_s, cache_size=0, spare=True) as grader:
        grader.start()
        latencies, per_item = [], {}
        wall0 = time.perf_counter()
        for name, response, truth in items:
            t = time.perf_counter()
            [outcome] = grader.grade([("math", response, truth)])
            latencies.append(time.perf_counter() - t)
            per_item[name] = {"seconds": latencies[-1], "timed_out": outcome.timed_out}
        wall = time.perf_counter() - wall0
    return _row(
        "ours", "pathological", len(items), wall, 0.0, latencies, timeouts=grader.timeouts, items=per_item
    )


_REF_CHILD = (
    "import json,sys; from bench.reward_workloads import easyr1_score; d=json.load(sys.stdin); "
    "print(easyr1_score(d['r'], d['t']))"
)


def bench_reference_pathological(items, kill_s: float) -> dict:
    latencies, per_item, killed = [], {}, 0
    for name, response, truth in items:
        proc = subprocess.Popen(
            [sys.executable, "-c", _REF_CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.0)
        t = time.perf_counter()
        try:
            proc.communicate(json.dumps({"r": response, "t": truth}).encode(), timeout=kill_s)
            status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            status, killed = f"killed after {kill_s:.0f} s", killed + 1
        latencies.append(time.perf_counter() - t)
        per_item[name] = {"seconds": latencies[-1], "status": status}
    return _row(
        "reference",
        "pathological",
        len(items),
        sum(latencies),
        0.0,
        latencies,
        killed=killed,
        items=per_item,
        note="includes ~0.3 s interpreter+import per item (subprocess)",
    )


def bench_redis_worker(groups, timeout_s: float) -> dict:
    import broker
    from broker.channel import Publisher
    from broker.config import BrokerConfig
    from broker.redis_server import LocalRedis
    from reward_service.config import RewardConfig
    from reward_service.worker import RewardWorker
    from runtime.metrics import MetricsConfig

    rollouts = [_make_group(f"g{i}", truth, responses) for i, (truth, responses) in enumerate(groups)]
    namespace = f"bench-{uuid.uuid4().hex[:8]}"
    with LocalRedis() as server:
        with broker.connect(server.url) as transport:
            Publisher(transport, f"{namespace}:rollouts").publish_many(rollouts)
        cfg = RewardConfig(
            broker=BrokerConfig(url=server.url, namespace=namespace, claim_idle_s=30.0),
            metrics=MetricsConfig(port=0),
            burst=True,
            timeout_s=timeout_s,
            cache_size=0,
            spare_grader=False,
            block_s=0.05,
        )
        worker = RewardWorker(cfg)
        worker.grader.start()  # startup and warm-up outside the timed window, as for "ours"
        for truth, responses in groups[:5]:
            worker.grader.grade([("math", r, truth) for r in responses])
        grader_startup_cpu = _proc_cpu_s(worker.grader._active.proc.pid)
        children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        worker.run()  # closes (and reaps) its grader at the end: its CPU lands in RUSAGE_CHILDREN
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu += (
            children1.ru_utime
            + children1.ru_stime
            - children0.ru_utime
            - children0.ru_stime
            - grader_startup_cpu
        )
        worker.close()
    n = worker.published * GROUP
    return _row(
        "ours+redis",
        "typical",
        n,
        wall,
        cpu,
        [wall / max(n, 1)],
        published=worker.published,
        note="wall includes the burst drain check at the end; cpu_s excludes redis-server; "
        "latency columns are the mean only",
    )


def bench_scale(groups, workers: int, timeout_s: float) -> dict:
    """`python -m reward_service --workers N` through redis: samples/s from publish to the last scored."""
    import signal
    import urllib.request

    import broker
    from broker.channel import Publisher
    from broker.redis_server import LocalRedis, free_port

    rollouts = [
        _make_group(f"g{c}-{i}", truth, responses)
        for c in range(workers)
        for i, (truth, responses) in enumerate(groups)
    ]
    namespace, port = f"bench-{uuid.uuid4().hex[:8]}", free_port()
    with LocalRedis() as server, broker.connect(server.url) as transport:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "reward_service",
                "--workers",
                str(workers),
                "--broker.url",
                server.url,
                "--broker.namespace",
                namespace,
                "--metrics.port",
                str(port),
                "--timeout-s",
                str(timeout_s),
                "--cache-size",
                "0",
                "--block-s",
                "0.05",
                "--log-level",
                "WARNING",
            ]
        )
        try:
            for index in range(workers):  # a worker serves metrics once its grader is up: all ready
                _wait_http(f"http://127.0.0.1:{port + index}/metrics", proc, urllib.request)
            started = time.perf_counter()
            Publisher(transport, f"{namespace}:rollouts").publish_many(rollouts, timeout=None)
            while transport.backlog(f"{namespace}:scored") < len(rollouts):
                if proc.poll() is not None:
                    raise RuntimeError(f"reward_service exited with {proc.returncode}")
                time.sleep(0.01)
            wall = time.perf_counter() - started
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    n = len(rollouts) * GROUP
    return _row(
        f"ours x{workers}",
        "typical",
        n,
        wall,
        0.0,
        [wall / n],
        workers=workers,
        samples_per_s_per_worker=n / wall / workers,
        note="N worker processes through redis-server (N x the typical groups), publish to last scored",
    )


def _wait_http(url: str, proc, urllib_request, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib_request.urlopen(url, timeout=1).read()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"reward worker behind {url} never came up") from None
            time.sleep(0.05)


def format_table(rows: list[dict]) -> str:
    columns = [
        "path",
        "workload",
        "samples",
        "samples/s",
        "per cpu-s",
        "p50 ms",
        "p99 ms",
        "max ms",
        "timeouts",
    ]
    keys = ["path", "workload", "samples", "samples_per_s", "samples_per_cpu_s", "p50_ms", "p99_ms", "max_ms"]
    body = [[r.get(k) for k in keys] + [r.get("timeouts", r.get("killed"))] for r in rows]
    return table("reward scoring, side by side on the same items", columns, body)


def run(config: BenchConfig) -> dict:
    groups = typical_groups(config.groups, config.seed)
    items = pathological_items()
    ref_typ, ref_results = bench_reference_typical(groups)
    ours_typ, our_results = bench_ours_typical(groups, config.timeout_s)
    rows = [ref_typ, ours_typ]
    if config.redis:
        rows.append(bench_redis_worker(groups, config.timeout_s))
    if config.redis:
        rows += [bench_scale(groups, n, config.timeout_s) for n in config.scale_workers]
    rows += [
        bench_reference_pathological(items, config.ref_kill_s),
        bench_ours_pathological(items, config.timeout_s),
    ]
    redis_row = next((r for r in rows if r["path"] == "ours+redis"), None)
    agree = sum(a == b for a, b in zip(ref_results, our_results)) / len(ref_results)
    accuracy = sum(a for a, _ in our_results) / len(our_results)
    return {
        "config": {k: str(v) for k, v in vars(config).items()},
        "rows": rows,
        "ratios": {
            "typical_ours_over_reference_samples_per_s": ours_typ["samples_per_s"] / ref_typ["samples_per_s"],
            "typical_ours_over_reference_per_cpu_s": ours_typ["samples_per_cpu_s"]
            / ref_typ["samples_per_cpu_s"],
            "pathological_ours_over_reference_wall": rows[-1]["wall_s"] / rows[-2]["wall_s"],
            **(
                {
                    "typical_redis_worker_over_reference_samples_per_s": redis_row["samples_per_s"]
                    / ref_typ["samples_per_s"],
                    "typical_redis_worker_over_reference_per_cpu_s": redis_row["samples_per_cpu_s"]
                    / ref_typ["samples_per_cpu_s"],
                }
                if redis_row
                else {}
            ),
        },
        "typical_agreement_with_reference": agree,
        "typical_accuracy": accuracy,
    }


def main(argv: list[str] | None = None) -> int:
    config = tyro.cli(BenchConfig, args=argv)
    result = run(config)
    print(format_table(result["rows"]))
    print(
        f"agreement with reference (typical): {result['typical_agreement_with_reference']:.4f}; "
        f"accuracy of the typical mix: {result['typical_accuracy']:.2f}"
    )
    print("ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in result["ratios"].items()))
    write_result(result, config.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
