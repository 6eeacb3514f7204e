"""Publish-once-then-ack of scored groups, optionally on a thread beside the grading.

`Outbox.submit(delivery, group, scores)` claims the group id (`OnceGate`), publishes the
`ScoredGroup` to `names.scored` (holding on through backpressure), marks the id done and only then
acks the delivery on `names.rollouts`. With `threaded=True` this runs on one background thread with
its own broker connection, so the worker grades the next group while this one's broker round trips
(about six) are in flight: the grader process never waits on the network. The queue is bounded
(`depth`): at most that many scored groups wait, still pending on the stream, so a crash loses no
work (they are redelivered and the publish-once gate keeps them single). An exception on the thread
is re-raised in the worker at its next `submit` or at `close`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from broker.channel import Publisher
from broker.names import Names
from broker.schemas import RolloutGroup, Score, ScoredGroup
from broker.transport import BackpressureTimeout, Delivery, Transport
from reward_service.dedupe import Claim, OnceGate
from reward_service.metrics import RewardMetrics

log = logging.getLogger(__name__)
_CLOSE = None


class Outbox:
    """See the module docstring."""

    def __init__(
        self,
        transport: Transport,
        names: Names,
        consumer: str,
        metrics: RewardMetrics,
        *,
        stopping: Callable[[], bool],
        publish_timeout_s: float = 5.0,
        claim_stale_s: float = 60.0,
        dedupe_ttl_s: float | None = None,
        threaded: bool = False,
        depth: int = 2,
        close_transport: bool = False,
    ) -> None:
        self.transport = transport
        self.names = names
        self.consumer = consumer
        self.metrics = metrics
        self.stopping = stopping
        self.publish_timeout_s = publish_timeout_s
        self.close_transport = close_transport
        self.publisher = Publisher(transport, names.scored)
        self.gate = OnceGate(transport, names, consumer, stale_s=claim_stale_s, ttl_s=dedupe_ttl_s)
        self.published = 0
        self.duplicates = 0
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._drain, name=f"outbox-{consumer}", daemon=True)
            self._thread.start()

    def submit(self, delivery: Delivery, group: RolloutGroup, scores: list[Score]) -> None:
        """Publish (once) and ack, now or on the thread."""
        self._raise_pending_error()
        if self._queue is None:
            self.deliver(delivery, group, scores)
        else:
            self._queue.put((delivery, group, scores))

    def deliver(self, delivery: Delivery, group: RolloutGroup, scores: list[Score]) -> None:
        """Claim, publish, mark done, ack (in this thread)."""
        claim = self.gate.claim(group.group_id)
        if claim is Claim.DONE:
            return self.ack_duplicate(delivery, group)
        if claim is Claim.BUSY:
            log.info("group %s is being published by another worker; leaving it pending", group.group_id)
            return
        if not self._publish(ScoredGroup(group=group, scores=scores, scorer_id=self.consumer)):
            self.gate.release(group.group_id)
            return
        self.gate.finish(group.group_id)
        self._ack(delivery)
        self.published += 1
        self.metrics.groups.inc()

    def ack_duplicate(self, delivery: Delivery, group: RolloutGroup) -> None:
        log.info("group %s already scored; acking delivery %s", group.group_id, delivery.id)
        self._ack(delivery)
        self.duplicates += 1
        self.metrics.duplicates.inc()

    def _publish(self, scored: ScoredGroup) -> bool:
        """Publish, holding on through backpressure; False only when stopped before it went out."""
        while True:
            try:
                self.publisher.publish(scored, timeout=self.publish_timeout_s)
                return True
            except BackpressureTimeout:
                if self.stopping():
                    return False
                self.gate.renew(scored.group.group_id)  # alive: the claim must not go stale meanwhile
                log.warning(
                    "%s is full; holding group %s until the learner catches up",
                    self.names.scored,
                    scored.group.group_id,
                )

    def _ack(self, delivery: Delivery) -> None:
        self.transport.ack(self.names.rollouts, Names.REWARD, [delivery.id])

    def _drain(self) -> None:
        while (item := self._queue.get()) is not _CLOSE:
            try:
                if self._error is None:
                    self.deliver(*item)
            except BaseException as exc:  # noqa: BLE001 - handed to the worker thread
                self._error = exc
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _raise_pending_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Finish what was submitted, stop the thread, re-raise its error if it had one."""
        try:
            if self._thread is not None and self._thread.is_alive():
                self._queue.put(_CLOSE)
                self._thread.join()
            self._raise_pending_error()
        finally:
            if self.close_transport:
                self.transport.close()
