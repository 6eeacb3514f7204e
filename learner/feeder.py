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

The cursor (epoch, index in the epoch, published count) goes into every checkpoint and, after
every publish, to the broker (`names.feeder_cursor`): published prompts are durable in the
stream, so a restart continues after the last one published and never publishes one twice.
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
from broker.names import Names
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
        self.publisher = Publisher(transport, names.prompts)
        self.images = ImageStore(transport, names)
        self._order = self._epoch_order(0)

    @property
    def exhausted(self) -> bool:
        """True once every prompt of every epoch was published."""
        return self.state.epoch >= self.epochs

    def load_state(self, checkpointed: dict | None) -> None:
        """Resume from the newer of the checkpoint's cursor and the broker's (published prompts are durable)."""
        candidates = [FeederState(**checkpointed)] if checkpointed else []
        stored = self.transport.get_value(self.names.feeder_cursor)
        if stored:
            candidates.append(FeederState(**json.loads(stored)))
        if candidates:
            self.state = max(candidates, key=lambda s: s.published)
        self._order = self._epoch_order(self.state.epoch)
        log.info(
            "feeder cursor: epoch %d, index %d, %d published",
            self.state.epoch,
            self.state.index,
            self.state.published,
        )

    def top_up(self, consumed: int, version: int) -> int:
        """Publish until `ahead` prompts are in flight; returns how many were published.

        `consumed` counts the groups that came back and hold no slot of the step being collected
        (received minus those already taken into its batch), so that queue position 0 is the
        first slot of the step the learner at `version` is collecting.
        """
        batch: list[PromptRecord] = []
        while not self.exhausted and self.state.published + len(batch) - consumed < self.ahead:
            position = self.state.published + len(batch) - consumed
            record = self._next_record()
            min_version = admission_min_version(version, position, self.groups_per_step, self.max_staleness)
            batch.append(msgspec.structs.replace(record, min_version=min_version, split="train"))
        if batch:
            for record in batch:
                self._store_images(record)
            self.publisher.publish_many(batch)
            self.state.published += len(batch)
            self.transport.set_value(self.names.feeder_cursor, json.dumps(self.state.to_dict()).encode())
        return len(batch)

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
