"""One reward worker process: consume RolloutGroups, score every sample, publish ScoredGroups.

Each worker is a consumer of group `Names.REWARD` on `names.rollouts` (so workers on other hosts
join the same group), grades through its own `SafeGrader` (hard timeout, killable process) and
publishes a `ScoredGroup` to `names.scored` once per group id (`OnceGate`), acking a delivery
only after its group was published (or found already published). Malformed entries are
dead-lettered by `broker.channel.Subscriber`; entries left pending by a dead worker are reclaimed
by the transport on a later read (XAUTOCLAIM after `claim_idle_s`).

The loop keeps a window of at most `groups_per_read` groups sent to the grader: while the grader
works on the oldest, the next is already queued in its pipe and the window is topped up with a
non-blocking read, so the grader does not wait for broker round trips. A group waits behind at
most `groups_per_read - 1` others, each bounded by `group_budget_s` (hence the config's check
against `claim_idle_s`).

`python -m reward_service.worker` runs one worker whose resolved config arrives as JSON on stdin
(how `python -m reward_service --workers N` starts its children: no secrets on the command line).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from collections import deque

from broker.channel import Subscriber
from broker.names import Names
from broker.schemas import RolloutGroup
from broker.transport import Delivery, Transport
from reward_service.config import RewardConfig
from reward_service.dedupe import OnceGate
from reward_service.metrics import RewardMetrics
from reward_service.outbox import Outbox
from reward_service.pool import SafeGrader
from reward_service.rewards import DEFAULT_ROUTES
from reward_service.scoring import GroupScorer, Pending
from runtime.config import from_dict
from runtime.heartbeat import Heartbeat
from runtime.metrics import start_metrics_server
from runtime.redact import setup_logging

log = logging.getLogger("reward_service.worker")


def consumer_name(cfg: RewardConfig, index: int) -> str:
    prefix = cfg.consumer or f"{socket.gethostname()}-{os.getpid()}"
    return f"{prefix}-{index}"


def connect(cfg: RewardConfig) -> Transport:
    return cfg.broker.connect()


class RewardWorker:
    """The consume-score-publish-ack loop of one process; `run()` until `stop()` (or drained in burst)."""

    def __init__(self, cfg: RewardConfig, index: int = 0, transport: Transport | None = None) -> None:
        self.cfg = cfg
        self.index = index
        self.names = Names(cfg.broker.namespace)
        self.consumer = consumer_name(cfg, index)
        sources = tuple(sorted({*DEFAULT_ROUTES, *cfg.routes}))
        self.metrics = RewardMetrics(data_sources=sources)
        self.transport = transport if transport is not None else connect(cfg)
        self.subscriber = Subscriber(
            self.transport,
            self.names.rollouts,
            Names.REWARD,
            self.consumer,
            expect=RolloutGroup,
            registry=self.metrics.registry,
        )
        self.grader = SafeGrader(
            cfg.timeout_s, cfg.memory_mb, spare=cfg.spare_grader, cache_size=cfg.cache_size
        )
        self.scorer = GroupScorer(self.grader, cfg.weights, cfg.routes, cfg.default_reward, self.metrics)
        threaded = cfg.publish_thread and transport is None
        self.outbox = Outbox(
            connect(cfg) if threaded else self.transport,
            self.names,
            self.consumer,
            self.metrics,
            stopping=lambda: self._stopping,
            publish_timeout_s=cfg.publish_timeout_s,
            claim_stale_s=cfg.claim_stale_s,
            dedupe_ttl_s=cfg.dedupe_ttl_s,
            threaded=threaded,
            close_transport=threaded,
        )
        self.gate = OnceGate(self.transport, self.names, self.consumer, stale_s=cfg.claim_stale_s)
        self._stopping = False
        self.heartbeat = Heartbeat.from_env(f"-{index}")
        """Beaten once per loop (runtime/heartbeat.py): the launcher's watchdog restarts a stuck worker."""

    @property
    def published(self) -> int:
        return self.outbox.published

    @property
    def duplicates(self) -> int:
        return self.outbox.duplicates

    def stop(self, *_signal_args) -> None:
        """Finish the group in hand, then return from `run`."""
        self._stopping = True

    def run(self) -> int:
        """Serve until stopped (or, with `burst`, until the stream is drained); returns groups published."""
        self.grader.start()
        port = start_metrics_server(self.cfg.metrics, self.metrics.registry, self.index)
        log.info(
            "worker %s consuming %s (metrics port %s)", self.consumer, self.names.rollouts, port or "off"
        )
        empty_polls = 0
        window: deque[tuple[Delivery, Pending, float]] = deque()  # sent to the grader, oldest first
        try:
            while not self._stopping:
                self.heartbeat()
                room = self.cfg.groups_per_read - len(window)
                if room > 0:  # top up (without waiting while there is work in hand)
                    batch = self.subscriber.poll(count=room, block_s=0.0 if window else self.cfg.block_s)
                    if not window:
                        empty_polls = 0 if batch else empty_polls + 1
                        if not batch and self.cfg.burst and self._drained(empty_polls):
                            break
                    for delivery, group in batch:
                        if (started := self.accept(delivery, group)) is not None:
                            window.append(started)
                if window:  # groups left in the window when stopping stay pending: reclaimed later
                    self.complete(*window.popleft())
        finally:
            self.grader.close()
            self.outbox.close()
        log.info(
            "worker %s done: %d published, %d duplicates", self.consumer, self.published, self.duplicates
        )
        return self.published

    def handle(self, delivery: Delivery, group: RolloutGroup) -> None:
        """Score one group and hand it to the outbox (publish once, then ack)."""
        if (started := self.accept(delivery, group)) is not None:
            self.complete(*started)

    def accept(self, delivery: Delivery, group: RolloutGroup) -> tuple[Delivery, Pending, float] | None:
        """Send a new group to the grader; None (and acked) when a redelivered group was already published."""
        if delivery.attempts > 1 and self.gate.is_done(group.group_id):
            self.outbox.ack_duplicate(delivery, group)  # redelivered after it was published: skip
            return None
        started = time.monotonic()
        return delivery, self.scorer.submit(group, self.cfg.group_budget_s), started

    def complete(self, delivery: Delivery, pending: Pending, started: float) -> None:
        """Wait for an accepted group's scores and hand it to the outbox (publish once, then ack)."""
        scores = self.scorer.finish(pending)
        pending.group.timings["reward"] = time.monotonic() - started
        self.outbox.submit(delivery, pending.group, scores)

    def _drained(self, empty_polls: int) -> bool:
        """Nothing pending and nothing left to read (a poll can be empty because it only held garbage)."""
        if self.transport.pending(self.names.rollouts, Names.REWARD) > 0:
            return False
        return empty_polls >= 3 or self.transport.backlog(self.names.rollouts) == 0

    def close(self) -> None:
        self.grader.close()
        self.outbox.close()
        self.transport.close()


def run_worker(cfg: RewardConfig, index: int = 0) -> int:
    """Run one worker in this process with SIGTERM/SIGINT stopping it cleanly; returns groups published."""
    worker = RewardWorker(cfg, index)
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    try:
        return worker.run()
    finally:
        worker.close()


def main() -> int:
    """Entry of a child started by `python -m reward_service`: {"config": {...}, "index": i} on stdin."""
    spec = json.load(sys.stdin)
    cfg = from_dict(RewardConfig, spec["config"])
    setup_logging(cfg.log_level, f"%(asctime)s reward[{spec['index']}] %(levelname)s %(message)s")
    run_worker(cfg, int(spec["index"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
