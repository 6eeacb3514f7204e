"""Rank 0's side of the scored stream: what the learner takes, skips, and acks when.

`Inbox.collect(version)` tops up the prompt feeder and reads scored groups until one step's
worth (`groups_per_step`) of trainable groups is in hand (`wait=False`: only if they are all here now,
else NOT_READY, keeping those taken for the next call):
  * evaluation groups (split != "train") go to the evaluator and are acked at once;
  * a redelivery of an entry this learner holds unacked (taken, waiting for its checkpoint) is
    ignored (counted as `redelivered`); the held delivery gets the ack;
  * another entry of a group id already consumed (trained on or skipped, before or after the
    last checkpoint) is dead-lettered ("already consumed") and counted as `duplicate`;
  * a group the feeder did not publish (its id is not in the feeder's in-flight set) is
    dead-lettered ("not published by this learner") and counted as `unexpected`;
    neither kind frees a slot of the feeder's window;
  * malformed groups (sample/score/logprob counts disagree, token ids outside the vocabulary,
    image pads in the prompt that do not match its images, wrong temperature, an image missing
    from the blob store or undecodable) are dead-lettered with the reason and counted as
    `malformed`; groups with a non-finite reward or behaviour logprob likewise, counted as
    `nonfinite` (the group alone: the step trains on the others);
  * empty groups (a generator rejected the prompt) and, with dynamic sampling, groups whose
    rewards are all equal are skipped and counted.
The first skip of each kind is logged with its detail (the routine kinds, `redelivered` and
`zero_variance`, at INFO; the rest as warnings) and kept in `first_skips`: a run whose every group is
rejected says why.
Every train group taken or skipped joins `consumed`. The deliveries of a step stay with the
step until the trainer finished it (`commit()`, which also dead-letters the step's malformed
groups), and are acked only by `ack_durable()`, which the trainer calls after a checkpoint made
them durable. So a crash, or a stop in the middle of a step, re-delivers exactly the groups
whose effect was lost, and the checkpointed `consumed` set drops the ones whose effect was kept.
With `checkpoint.keep` >= 2 the acks lag one checkpoint (`ack_generations`): a step's deliveries are
acked by the second `ack_durable()` after it, once two checkpoints hold them, so a learner that falls
back to the previous checkpoint (the newest one damaged, learner/checkpoint.py) gets back every group
the damaged one held. A redelivered entry of a group already consumed (one the newest checkpoint holds
and has not acked yet) is held and acked with the current step, counted as `redelivered`.
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
from learner.config import LearnerConfig
from learner.evaluation import Evaluator
from learner.feeder import PromptFeeder
from learner.samples import nonfinite_problem, validate_group
from runtime.heartbeat import Heartbeat

log = logging.getLogger(__name__)


class NotReady:
    """`Inbox.collect(wait=False)`'s answer while the step's groups are not all here."""

    def __repr__(self) -> str:
        return "NOT_READY"


NOT_READY = NotReady()

ROUTINE_SKIPS = ("redelivered", "zero_variance")
"""Skips that a healthy run makes (a redelivery after a reclaim; dynamic sampling's uniform groups)."""


def ack_generations(cfg: LearnerConfig) -> int:
    """Checkpoints that hold a step before its deliveries are acked: 2 where the previous checkpoint is
    kept (a damaged newest one falls back to it), else 1."""
    return 2 if cfg.checkpoint.every >= 0 and cfg.checkpoint.keep >= 2 else 1


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
        image_token_id: int | None = None,
        check_image=None,
    ):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.image_token_id = image_token_id
        """The image pad id: a prompt whose pads and images disagree is dead-lettered, naming both counts."""
        self.check_image = check_image
        """`ref -> None`, raising when the image cannot be fetched or decoded (also warms rank 0's cache)."""
        self.sub = Subscriber(
            transport, names.scored, Names.LEARNER, cfg.consumer, expect=ScoredGroup, registry=registry
        )
        self.feeder, self.evaluator = feeder, evaluator
        self.consumed: set[str] = set()
        self.unacked: list[Delivery] = []
        """Deliveries of finished steps, acked by the next `ack_durable`."""
        self._step: list[tuple[Delivery, str]] = []  # (delivery, group id) of the step being collected
        self._batch: list[ScoredGroup] = []  # its groups taken so far (`collect`)
        self._step_rejects: list[tuple[Delivery, str, str, str]] = []  # (delivery, group id, reason, detail)
        self._committed: set[str] = set()  # group ids of `unacked` and of committed rejects
        self._durable: list[tuple[list[Delivery], set[str]]] = []  # checkpointed, acked one checkpoint later
        self.generations = ack_generations(cfg)
        self._held: set[str] = set()  # entry ids taken and not acked yet
        self.skipped: Counter[str] = Counter()
        self.first_skips: dict[str, str] = {}
        """The detail of the first skip of each kind (`skipped`'s keys)."""
        self.on_skip = on_skip or (lambda reason: None)
        self.eval_metrics: list[dict[str, float]] = []
        self.heartbeat = Heartbeat.from_env()
        """Beaten while a step is collected (runtime/heartbeat.py): the launcher's watchdog restarts a stuck
        learner."""

    def restore(self, consumed: list[str]) -> None:
        """Resume with the checkpoint's consumed ids."""
        self.consumed = set(consumed)

    def collect(
        self, version: int, idle_timeout_s: float = 0.0, *, wait: bool = True
    ) -> list[ScoredGroup] | None | NotReady:
        """One step's trainable groups; None when the data is exhausted (or idle past the timeout). With
        `wait=False`: NOT_READY unless the step's groups are all here now (those taken so far stay for the
        next call)."""
        want = self.cfg.algo.groups_per_step
        idle_since = time.monotonic()
        while len(self._batch) < want:
            self.heartbeat()
            self._feed(version, taken=len(self._batch))
            if self._finished():
                return None
            got = self.sub.poll(count=want - len(self._batch), block_s=0.5 if wait else 0.0)
            if got:
                idle_since = time.monotonic()
            elif not wait:
                return NOT_READY
            elif idle_timeout_s > 0 and time.monotonic() - idle_since > idle_timeout_s:
                log.warning("no scored groups for %.0f s: stopping", idle_timeout_s)
                return None
            for delivery, scored in got:
                if self._take(delivery, scored):
                    self._batch.append(scored)
        batch, self._batch = self._batch, []
        return batch

    @property
    def taken(self) -> int:
        """Groups of the step being collected taken so far (what a NOT_READY `collect` keeps)."""
        return len(self._batch)

    def commit(self) -> None:
        """The step collected last was trained (its groups are in the trainer's consumed state):
        its deliveries wait for the next checkpoint, its malformed groups are dead-lettered."""
        for delivery, gid in self._step:
            self.unacked.append(delivery)
            self._committed.add(gid)
        for delivery, gid, reason, detail in self._step_rejects:
            self.sub.reject(delivery, reason, detail)
            self._held.discard(delivery.id)
            self._committed.add(gid)
        self._step, self._step_rejects = [], []

    def ack_durable(self) -> int:
        """A checkpoint holds every committed step: ack the deliveries that `generations` checkpoints hold
        now (see the module docstring); returns how many were acked."""
        self._durable.append((self.unacked, self._committed))
        self.unacked, self._committed = [], set()
        n = 0
        while len(self._durable) >= self.generations:
            deliveries, committed = self._durable.pop(0)
            if deliveries:
                self.sub.ack(deliveries)
                self._held.difference_update(d.id for d in deliveries)
                n += len(deliveries)
            if self.feeder is not None:
                self.feeder.mark_durable(committed)
        return n

    def _feed(self, version: int, taken: int = 0) -> None:
        """Top up the feeder; the `taken` groups of this step's batch still occupy their slots."""
        if self.feeder is not None:
            self.feeder.top_up(taken=taken, version=version)
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
            and not self.feeder.in_flight
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
        if delivery.id in self._held:
            # the held delivery is acked with the next checkpoint
            self._skip("redelivered", f"entry {delivery.id}")
            return False
        if group.group_id in self.consumed and delivery.attempts > 1:
            # held by the newest checkpoint and not acked yet (acks lag one): ack it with this step's
            self._step.append((delivery, group.group_id))
            self._held.add(delivery.id)
            self._skip("redelivered", f"entry {delivery.id} of group {group.group_id}: already consumed")
            return False
        if group.group_id in self.consumed:
            self._dead_letter(delivery, "duplicate", f"group {group.group_id}: already consumed")
            return False
        if self.feeder is not None and not self.feeder.expects(group.group_id):
            self._dead_letter(
                delivery, "unexpected", f"group {group.group_id}: not published by this learner"
            )
            return False
        reason, problem = "malformed", validate_group(scored, self.vocab_size, self.image_token_id)
        if problem is None:
            reason, problem = "nonfinite", nonfinite_problem(scored)
        if problem is None and abs(group.temperature - self.cfg.algo.temperature) > 1e-6:
            reason = "malformed"
            problem = f"sampled at temperature {group.temperature}, learner uses {self.cfg.algo.temperature}"
        if problem is None:
            reason, problem = "malformed", self._image_problem(group)
        self._consume(group.group_id)
        self._held.add(delivery.id)
        if problem is not None and problem != "empty":
            self._step_rejects.append(
                (delivery, group.group_id, reason, f"group {group.group_id}: {problem}")
            )
            self._skip(reason, f"group {group.group_id}: {problem}")
            return False
        self._step.append((delivery, group.group_id))
        if problem == "empty":
            self._skip("empty", f"group {group.group_id}: no samples (its generator rejected the prompt)")
            return False
        if self.cfg.algo.dynamic_sampling and not has_variance([s.reward for s in scored.scores]):
            self._skip("zero_variance", f"group {group.group_id}: every sample has the same reward")
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
        """The group came back: it joins `consumed` and frees its slot in the feeder's window."""
        self.consumed.add(group_id)
        if self.feeder is not None:
            self.feeder.returned(group_id)

    def _dead_letter(self, delivery: Delivery, reason: str, detail: str) -> None:
        self.sub.reject(delivery, reason, detail)
        self._skip(reason, detail)

    def _skip(self, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        self.on_skip(reason)
        if reason not in self.first_skips:
            self.first_skips[reason] = detail
            level = logging.INFO if reason in ROUTINE_SKIPS else logging.WARNING
            log.log(
                level,
                "skipped a group (%s): %s; later ones are counted as skipped/%s",
                reason,
                detail,
                reason,
            )

    def skip_summary(self) -> str:
        """Skips by kind with the first one's detail, e.g. for a run that ends without training."""
        if not self.skipped:
            return "none skipped"
        return "; ".join(f"{n} {r} (first: {self.first_skips[r]})" for r, n in self.skipped.most_common())
