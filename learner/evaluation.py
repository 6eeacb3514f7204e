"""Periodic evaluation on the test split, through the generators, without stopping training.

Every `every` steps the evaluator publishes the test prompts (tagged with the round, at
`min_version` = the current version, split "test", so the generators sample them with their
evaluation parameters: greedy or T=0.6). Scored evaluation groups arrive on the learner's
scored stream among the training ones; the trainer hands them to `add`. A round finishes when
every prompt came back or `timeout_s` passed (the missing ones are counted); `poll` then returns
the accuracy and reward per data source. One round runs at a time.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence

from broker.schemas import PromptRecord, ScoredGroup
from learner.config import EvalConfig
from learner.feeder import PromptFeeder, eval_round_of

log = logging.getLogger(__name__)


class Evaluator:
    """Runs evaluation rounds over `records` (the test split) through `feeder`."""

    def __init__(self, feeder: PromptFeeder, records: Sequence[PromptRecord], cfg: EvalConfig):
        self.feeder = feeder
        self.records = list(records)[: cfg.max_prompts] if cfg.max_prompts > 0 else list(records)
        self.cfg = cfg
        self.round: int | None = None
        self.started_at = 0.0
        self.version = 0
        self.expected: set[str] = set()
        self.results: dict[str, list[tuple[float, float]]] = defaultdict(list)
        self.seen: set[str] = set()

    @property
    def running(self) -> bool:
        return self.round is not None

    def due(self, step: int) -> bool:
        """True when a round should start after `step`."""
        return bool(self.records) and self.cfg.every > 0 and step % self.cfg.every == 0 and not self.running

    def start(self, step: int, version: int) -> int:
        """Publish the test prompts for a round named after `step`; returns how many."""
        self.round, self.version, self.started_at = step, version, time.monotonic()
        self.expected = set(self.feeder.publish_eval(self.records, step, version))
        self.results.clear()
        self.seen.clear()
        log.info("evaluation round %d: %d test prompts at version %d", step, len(self.expected), version)
        return len(self.expected)

    def add(self, scored: ScoredGroup) -> bool:
        """Take one scored evaluation group; False when it belongs to no running round (stale)."""
        group = scored.group
        if self.round is None or eval_round_of(group.prompt_id) != self.round or group.prompt_id in self.seen:
            return False
        if group.prompt_id not in self.expected:
            return False
        self.seen.add(group.prompt_id)
        for score in scored.scores:
            self.results[group.data_source].append((score.accuracy, score.reward))
        return True

    def poll(self) -> dict[str, float] | None:
        """The round's metrics once it finished (all prompts back, or timed out); else None."""
        if self.round is None:
            return None
        done = self.seen >= self.expected
        if not done and time.monotonic() - self.started_at < self.cfg.timeout_s:
            return None
        metrics: dict[str, float] = {
            "eval/round": float(self.round),
            "eval/version": float(self.version),
            "eval/missing": float(len(self.expected - self.seen)),
        }
        all_acc = []
        for source, pairs in sorted(self.results.items()):
            accs = [a for a, _ in pairs]
            all_acc.extend(accs)
            metrics[f"eval/accuracy/{source}"] = sum(accs) / len(accs)
            metrics[f"eval/reward/{source}"] = sum(r for _, r in pairs) / len(pairs)
        metrics["eval/accuracy"] = sum(all_acc) / len(all_acc) if all_acc else 0.0
        if metrics["eval/missing"]:
            log.warning(
                "evaluation round %d timed out with %d prompts missing", self.round, metrics["eval/missing"]
            )
        self.round = None
        return metrics
