"""Rank 0's side of the scored stream: what the learner takes, skips, and acks when.

`Inbox.collect(version)` tops up the prompt feeder and reads scored groups until one step's
worth (`groups_per_step`) of trainable groups is in hand:
  * evaluation groups (split != "train") go to the evaluator and are acked at once;
  * a group id already consumed (trained on or skipped, before or after the last checkpoint)
    is a redelivery: skipped and counted as `duplicate`;
  * malformed groups (sample/score/logprob counts disagree, token ids outside the vocabulary,
    wrong temperature, an image missing from the blob store or undecodable) are
    dead-lettered with the reason and counted;
  * empty groups (a generator rejected the prompt) and, with dynamic sampling, groups whose
    rewards are all equal are skipped and counted.
Every train group taken or skipped joins `consumed`; its delivery is acked only by
`ack_durable()`, which the trainer calls after a checkpoint made it durable. So a crash
re-delivers exactly the groups whose effect was lost, and the checkpointed `consumed` set
drops the ones whose effect was kept.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

from broker.channel import Subscriber
from broker.names import Names
from broker.schemas import ScoredGroup
from broker.transport import Delivery, Transport
from learner.advantages import has_variance
from learner.batching import validate_group
from learner.config import LearnerConfig
from learner.evaluation import Evaluator
from learner.feeder import PromptFeeder

log = logging.getLogger(__name__)


class Inbox:
    """Consumes `names.scored` as the learner's consumer; see the module docstring."""

    def __init__(
        self,
        transport: Transport,
        names: Names,
        cfg: LearnerConfig,
        *,
        feeder: PromptFeeder | None = None,
        evaluator: Evaluator | None = None,
        registry=None,
        on_skip=None,
        vocab_size: int | None = None,
        check_image=None,
    ):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.check_image = check_image
        """`ref -> None`, raising when the image cannot be fetched or decoded (it also warms rank 0's cache)."""
        self.sub = Subscriber(
            transport, names.scored, Names.LEARNER, cfg.consumer, expect=ScoredGroup, registry=registry
        )
        self.feeder, self.evaluator = feeder, evaluator
        self.consumed: set[str] = set()
        self.unacked: list[Delivery] = []
        self.received = 0
        """Distinct training groups received (taken or skipped): what came back of the feeder's prompts."""
        self.skipped: Counter[str] = Counter()
        self.on_skip = on_skip or (lambda reason: None)
        self.eval_metrics: list[dict[str, float]] = []

    def restore(self, consumed: list[str], received: int) -> None:
        """Resume with the checkpoint's consumed ids."""
        self.consumed = set(consumed)
        self.received = received

    def collect(self, version: int, idle_timeout_s: float = 0.0) -> list[ScoredGroup] | None:
        """One step's trainable groups; None when the data is exhausted (or idle past the timeout)."""
        batch: list[ScoredGroup] = []
        want = self.cfg.algo.groups_per_step
        idle_since = time.monotonic()
        while len(batch) < want:
            self._feed(version, taken=len(batch))
            if self._finished():
                return None
            got = self.sub.poll(count=want - len(batch), block_s=0.5)
            if got:
                idle_since = time.monotonic()
            elif idle_timeout_s > 0 and time.monotonic() - idle_since > idle_timeout_s:
                log.warning("no scored groups for %.0f s: stopping", idle_timeout_s)
                return None
            for delivery, scored in got:
                if self._take(delivery, scored):
                    batch.append(scored)
        return batch

    def ack_durable(self) -> int:
        """Ack every delivery taken so far (call after a checkpoint holds their effect)."""
        n = len(self.unacked)
        if n:
            self.sub.ack(self.unacked)
            self.unacked = []
        return n

    def _feed(self, version: int, taken: int = 0) -> None:
        """Top up the feeder; the `taken` groups of this step's batch still occupy their slots."""
        if self.feeder is not None:
            self.feeder.top_up(consumed=self.received - taken, version=version)
        self._poll_eval()

    def _poll_eval(self) -> None:
        """Collect the metrics of an evaluation round that just finished (complete or timed out)."""
        if self.evaluator is not None:
            metrics = self.evaluator.poll()
            if metrics is not None:
                self.eval_metrics.append(metrics)

    def _finished(self) -> bool:
        """The feeder published everything and everything came back."""
        return (
            self.feeder is not None
            and self.feeder.exhausted
            and self.received >= self.feeder.state.published
            and (self.evaluator is None or not self.evaluator.running)
        )

    def _take(self, delivery: Delivery, scored: ScoredGroup) -> bool:
        """Bookkeeping for one delivery; True when the group should be trained on."""
        group = scored.group
        if group.split != "train":
            if self.evaluator is not None and self.evaluator.add(scored):
                self._poll_eval()
            self.sub.ack([delivery])
            return False
        if group.group_id in self.consumed:
            self._skip("duplicate", delivery, durable=True)
            return False
        problem = validate_group(scored, self.vocab_size)
        if problem is None and abs(group.temperature - self.cfg.algo.temperature) > 1e-6:
            problem = f"sampled at temperature {group.temperature}, learner uses {self.cfg.algo.temperature}"
        if problem is None:
            problem = self._image_problem(group)
        if problem is not None and problem != "empty":
            self.sub.reject(delivery, "malformed", f"group {group.group_id}: {problem}")
            self.skipped["malformed"] += 1
            self.on_skip("malformed")
            self._consume(group.group_id)
            return False
        self._consume(group.group_id)
        self.unacked.append(delivery)
        if problem == "empty":
            self._skip("empty")
            return False
        if self.cfg.algo.dynamic_sampling and not has_variance([s.reward for s in scored.scores]):
            self._skip("zero_variance")
            return False
        return True

    def _image_problem(self, group) -> str | None:
        if self.check_image is None:
            return None
        for ref in group.images:
            try:
                self.check_image(ref)
            except Exception as exc:  # noqa: BLE001 - missing blob, bad bytes, processor errors
                return f"image {ref.sha256[:16]}... unusable: {exc}"
        return None

    def _consume(self, group_id: str) -> None:
        self.consumed.add(group_id)
        self.received += 1

    def _skip(self, reason: str, delivery: Delivery | None = None, durable: bool = False) -> None:
        self.skipped[reason] += 1
        self.on_skip(reason)
        if delivery is not None and durable:
            self.unacked.append(delivery)  # acked with the next checkpoint (its group may not be durable yet)
