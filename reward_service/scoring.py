"""Scores a rollout group: route each sample to its reward, grade safely, combine the parts.

`GroupScorer.score(group)` returns one `broker.schemas.Score` per sample (`submit` then `finish`
does the same in two steps, so a worker can queue the next group while the grader works). Grading goes
through a
`SafeGrader` (hard timeout, separate process); when it times out or its process dies the sample
gets accuracy 0, `timed_out=True`, and the format part computed here (a linear-time check), so a
well-formed answer that merely hangs sympy keeps its format credit. Metrics are recorded per sample.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from broker.schemas import RolloutGroup, Score
from reward_service.metrics import RewardMetrics
from reward_service.pool import Outcome, SafeGrader, Ticket
from reward_service.rewards import DEFAULT_REWARD, Weights, load_format, route

log = logging.getLogger(__name__)


class Pending(NamedTuple):
    """A group sent to the grader (`GroupScorer.submit`), to `GroupScorer.finish`."""

    group: RolloutGroup
    reward: str
    ticket: Ticket


class GroupScorer:
    """Turns RolloutGroups into Scores with one `SafeGrader`."""

    def __init__(
        self,
        grader: SafeGrader,
        weights: Weights | None = None,
        routes: dict[str, str] | None = None,
        default_reward: str = DEFAULT_REWARD,
        metrics: RewardMetrics | None = None,
    ) -> None:
        self.grader = grader
        self.weights = weights or Weights()
        self.routes = dict(routes or {})
        self.default_reward = default_reward
        self.metrics = metrics

    def reward_name(self, data_source: str) -> str:
        return route(data_source, self.routes, self.default_reward)

    def score(self, group: RolloutGroup) -> list[Score]:
        """One Score per sample of `group`, in order."""
        return self.score_within(group, None)

    def score_within(self, group: RolloutGroup, budget_s: float | None) -> list[Score]:
        """Like `score`, with the whole group's grading bounded by `budget_s` seconds (None = no bound)."""
        return self.finish(self.submit(group, budget_s))

    def submit(self, group: RolloutGroup, budget_s: float | None) -> Pending:
        """Send the group's samples to the grader now (it grades them after what it already has)."""
        name = self.reward_name(group.data_source)
        items = [(name, sample.response_text, group.ground_truth) for sample in group.samples]
        return Pending(group, name, self.grader.submit(items, budget_s))

    def finish(self, pending: Pending) -> list[Score]:
        """The Scores of a submitted group, in sample order."""
        outcomes = self.grader.finish(pending.ticket)
        return [
            self._score(pending.reward, pending.group, item[1], outcome, sample.env_reward)
            for item, outcome, sample in zip(pending.ticket.items, outcomes, pending.group.samples)
        ]

    def _score(
        self, name: str, group: RolloutGroup, response: str, outcome: Outcome, env_reward: float = 0.0
    ) -> Score:
        """The sample's Score; a multi-turn episode's environment reward term is added to the reward."""
        accuracy, format = outcome.accuracy, outcome.format
        if outcome.failed or outcome.error:
            accuracy, format = 0.0, load_format(name)(response)
            self._count_failure(group, outcome)
        score = Score(
            reward=self.weights.combine(accuracy, format) + env_reward,
            accuracy=accuracy,
            format=format,
            timed_out=outcome.failed,
        )
        if self.metrics is not None:
            self.metrics.observe(group.data_source, score.reward, score.accuracy, outcome.seconds)
        return score

    def _count_failure(self, group: RolloutGroup, outcome: Outcome) -> None:
        if outcome.cached:
            return  # counted and logged when it happened
        what = (
            "timed out" if outcome.timed_out else "crashed the grader" if outcome.crashed else outcome.error
        )
        log.warning(
            "group %s (%s): grading %s after %.2f s; accuracy 0",
            group.group_id,
            group.data_source,
            what,
            outcome.seconds,
        )
        if self.metrics is None:
            return
        if outcome.timed_out:
            self.metrics.timeouts.inc()
        else:
            self.metrics.errors.labels("crash" if outcome.crashed else "exception").inc()
