"""The prompt feeder: the learner's data cursor, publishing PromptRecords to the generators.

The feeder walks the training prompts epoch by epoch (a seeded permutation per epoch), puts
each prompt's images into the broker's blob store and publishes the record to `names.prompts`.
It keeps `ahead` prompts in flight, counted from the first slot of the step being collected:
published and not yet come back as scored groups, plus those already taken into that step.

Staleness by admission (AReaL's rule, async-rl.md): a prompt at queue position q (0 = the next
group the learner will consume) published while the learner is at version v will be trained at
about step v + q // B (B = groups per step); it gets `min_version = v + q // B - K`, capped at
v, so a generator never starts it on weights more than K versions behind the step that trains
it, and never waits for a version the learner has not reached (no deadlock when dynamic
sampling drops groups). With ahead = B·(K+1) the cap never binds; K = 0 is synchronous.

The cursor (epoch, index in the epoch, published count) goes into every checkpoint and to the
broker (`names.feeder_cursor`) around every publish: published prompts are durable in the
stream, so a restart continues after the last one published and never publishes one twice.
A publish and the cursor write after it are two broker calls, and the learner can die between
them: so the cursor is written first with the batch about to go out (`publishing`, the count,
from the position before it), the batch is published with one idempotency key per position in
the run (`names.feeder_publish`, `Transport.publish_many(keys=...)`), then the cursor is written
again without it. A restart that finds `publishing` in the cursor publishes those positions
again, first thing, under the same keys: the broker appends the ones that never went out and
returns the original entry ids of the others, so the feeder again knows every group in flight.

Prompts in flight are tracked by id: each publish returns the entries' ids, and the group a
generator makes of a delivery has the id `broker.names.group_id(prompt_id, entry_id)`, so the
feeder holds the exact set of group ids it waits for (`in_flight`). `returned(group_id)` takes
one out; a group that is not in the set (never published, or already back) frees no slot, so
stray or duplicated entries never change the window. The set goes into each checkpoint, and
the broker's cursor carries every id published and not yet durably back (in flight, plus those
returned and not yet in a checkpoint, `awaiting_checkpoint`), so that after a crash the union of the two,
minus the checkpoint's consumed ids, is again exactly what is still to come.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from broker.channel import Publisher
from broker.images import ImageStore
from broker.names import Names, group_id
from broker.schemas import ImageRef, PromptRecord
from broker.transport import Transport

log = logging.getLogger(__name__)


@dataclass
class FeederState:
    """The data cursor."""

    epoch: int = 0
    """Current pass over the training prompts."""
    index: int = 0
    """Position of the next prompt in this epoch's order."""
    published: int = 0
    """Prompts published in total."""

    def to_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "published": self.published}


def admission_min_version(version: int, position: int, groups_per_step: int, max_staleness: int) -> int:
    """min_version of a prompt at queue `position` published at learner `version` (see module doc)."""
    return max(0, min(version, version + position // max(groups_per_step, 1) - max_staleness))


class PromptFeeder:
    """Publishes training prompts, keeping `ahead` of them in flight; rank 0 of the learner only."""

    def __init__(
        self,
        transport: Transport,
        names: Names,
        records: Sequence[PromptRecord],
        image_bytes: Callable[[ImageRef], bytes],
        *,
        groups_per_step: int,
        max_staleness: int,
        ahead: int = 0,
        epochs: int = 1,
        shuffle: bool = True,
        seed: int = 0,
    ):
        if not records:
            raise ValueError("the prompt feeder needs at least one training prompt")
        self.transport, self.names = transport, names
        self.records = list(records)
        self.image_bytes = image_bytes
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness
        self.ahead = ahead if ahead > 0 else groups_per_step * (max_staleness + 1)
        self.epochs, self.shuffle, self.seed = epochs, shuffle, seed
        self.state = FeederState()
        self.in_flight: set[str] = set()
        """Group ids published and not yet come back."""
        self.awaiting_checkpoint: set[str] = set()
        """Group ids come back since the last checkpoint (`mark_durable` drops them once one holds them)."""
        self.tracking = True
        """False after resuming from a cursor without in-flight ids (then every group is accepted)."""
        self.replay = 0
        """Positions a crash may have published without recording them: the next `top_up` publishes
        them again (under their keys) whatever the window."""
        self.publisher = Publisher(transport, names.prompts)
        self.images = ImageStore(transport, names)
        self._order = self._epoch_order(0)

    @property
    def exhausted(self) -> bool:
        """True once every prompt of every epoch was published."""
        return self.state.epoch >= self.epochs

    def load_state(self, checkpointed: dict | None, consumed: set[str] = frozenset()) -> None:
        """Resume from the newer of the checkpoint's cursor and the broker's (published prompts are
        durable; on a tie the broker's, which may list a publish in progress); in flight: the ids
        either one lists, minus the checkpoint's `consumed` ids."""
        sources = [checkpointed] if checkpointed else []
        stored = self.transport.get_value(self.names.feeder_cursor)
        if stored:
            sources.insert(0, json.loads(stored))
        if sources:
            fields = ("epoch", "index", "published")
            newest = max(sources, key=lambda src: src.get("published", 0))  # the first of equals
            self.state = FeederState(**{k: newest[k] for k in fields if k in newest})
            self.replay = int(newest.get("publishing", 0))
            self.tracking = self.state.published == 0 or any("in_flight" in src for src in sources)
            ids = {i for src in sources for i in src.get("in_flight", [])}
            self.in_flight = ids - set(consumed)
            if not self.tracking:
                log.warning("the feeder cursor lists no prompts in flight (older run): accepting every group")
        self._order = self._epoch_order(self.state.epoch)
        log.info(
            "feeder cursor: epoch %d, index %d, %d published, %d in flight, %d to publish again",
            self.state.epoch,
            self.state.index,
            self.state.published,
            len(self.in_flight),
            self.replay,
        )

    def cursor(self) -> dict:
        """What a checkpoint stores: the cursor and the group ids in flight."""
        return {**self.state.to_dict(), "in_flight": sorted(self.in_flight)}

    def expects(self, group_id: str) -> bool:
        """True when `group_id` is a group this feeder published and waits for."""
        return not self.tracking or group_id in self.in_flight

    def returned(self, group_id: str) -> bool:
        """Take `group_id` out of the in-flight set (its slot is free); False when it was not in it."""
        if group_id not in self.in_flight:
            return not self.tracking
        self.in_flight.discard(group_id)
        self.awaiting_checkpoint.add(group_id)
        return True

    def mark_durable(self, group_ids: set[str]) -> None:
        """These returned groups are durable (a checkpoint holds them as consumed): the broker's cursor stops
        listing them."""
        self.awaiting_checkpoint.difference_update(group_ids)

    def top_up(self, taken: int, version: int) -> int:
        """Publish until `ahead` prompts are in flight; returns how many were published.

        `taken` groups came back into the step being collected and still hold its slots, so that
        queue position 0 is the first slot of the step the learner at `version` is collecting.
        """
        before = FeederState(**self.state.to_dict())
        batch: list[PromptRecord] = []
        held = len(self.in_flight) + taken
        while not self.exhausted and (len(batch) < self.replay or held + len(batch) < self.ahead):
            position = held + len(batch)
            record = self._next_record()
            min_version = admission_min_version(version, position, self.groups_per_step, self.max_staleness)
            batch.append(msgspec.structs.replace(record, min_version=min_version, split="train"))
        if batch:
            self._publish(before, batch)
        self.replay = 0
        return len(batch)

    def _publish(self, before: FeederState, batch: list[PromptRecord]) -> None:
        """Publish `batch` (the positions after `before`) so that a crash at any point loses nothing
        and duplicates nothing (see the module docstring)."""
        for record in batch:
            self._store_images(record)
        self._write_cursor(before, publishing=len(batch))
        keys = [self.names.feeder_publish(before.published + i) for i in range(len(batch))]
        ids = self.publisher.publish_many(batch, keys=keys)
        self.in_flight.update(group_id(r.prompt_id, i) for r, i in zip(batch, ids, strict=True))
        self.state.published = before.published + len(batch)
        self._write_cursor(self.state)

    def _write_cursor(self, state: FeederState, publishing: int = 0) -> None:
        """The broker's copy of the cursor: every id published and not yet durably back."""
        cursor = {**state.to_dict(), "in_flight": sorted(self.in_flight | self.awaiting_checkpoint)}
        if publishing:
            cursor["publishing"] = publishing
        self.transport.set_value(self.names.feeder_cursor, json.dumps(cursor).encode())

    def publish_eval(self, records: Sequence[PromptRecord], round_id: int, version: int) -> list[str]:
        """Publish test prompts for one evaluation round; returns their (round-tagged) prompt ids."""
        tagged = [
            msgspec.structs.replace(
                r, prompt_id=eval_prompt_id(r.prompt_id, round_id), split="test", min_version=version
            )
            for r in records
        ]
        for record in tagged:
            self._store_images(record)
        self.publisher.publish_many(tagged)
        return [r.prompt_id for r in tagged]

    def _next_record(self) -> PromptRecord:
        record = self.records[self._order[self.state.index]]
        self.state.index += 1
        if self.state.index >= len(self._order):
            self.state.epoch += 1
            self.state.index = 0
            self._order = self._epoch_order(self.state.epoch)
        return record

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def _store_images(self, record: PromptRecord) -> None:
        for ref in record.images:
            stored = self.images.put(self.image_bytes(ref))
            if stored.sha256 != ref.sha256:
                raise ValueError(
                    f"{record.prompt_id}: image bytes hash to {stored.sha256}, record says {ref.sha256}"
                )


EVAL_SEP = "#eval"


def eval_prompt_id(prompt_id: str, round_id: int) -> str:
    """The prompt id an evaluation round publishes: the test prompt's id tagged with the round."""
    return f"{prompt_id}{EVAL_SEP}{round_id}"


def eval_round_of(prompt_id: str) -> int | None:
    """The round an evaluation prompt id belongs to (None for other ids)."""
    _, sep, tail = prompt_id.rpartition(EVAL_SEP)
    return int(tail) if sep and tail.isdigit() else None
