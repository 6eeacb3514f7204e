"""Configuration of `python -m reward_service` (one dataclass; a docstring under every field).

Resolved by `runtime.config.load_config`: defaults < `--config deploy/configs/reward.toml` < flags,
then validated. Shared sections: `broker` (broker.config.BrokerConfig: URL from
$PARALLAX_BROKER_URL, the Redis password from `--broker.password-file` or
$PARALLAX_BROKER_PASSWORD, so that it need not appear on a command line) and `metrics`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from broker.config import BrokerConfig
from reward_service.rewards import DEFAULT_REWARD, REWARDS, Weights
from runtime.metrics import MetricsConfig


@dataclass
class RewardConfig:
    """Everything `python -m reward_service` needs."""

    workers: int = 1
    """Worker processes on this host; every one joins the same consumer group as other hosts'."""
    accuracy_weight: float = 0.9
    """reward = accuracy_weight * accuracy + format_weight * format."""
    format_weight: float = 0.1
    """Weight of the think-then-boxed format part."""
    routes: dict[str, str] = field(default_factory=dict)
    """Data source -> reward name overrides (names: reward_service.rewards.REWARDS)."""
    default_reward: str = DEFAULT_REWARD
    """Reward for data sources that no route names."""
    timeout_s: float = 5.0
    """Hard limit on grading one response; past it the grader is killed and accuracy is 0."""
    memory_mb: int = 1024
    """Address-space cap of each grader process in MiB (0 = none)."""
    group_budget_s: float = 10.0
    """Seconds to grade one whole group; groups_per_read * group_budget_s must stay below broker.claim_idle_s
    (else another worker reclaims groups still waiting in this one's hands)."""
    spare_grader: bool = True
    """Keep a warm spare grader per worker so that a timeout costs no process start."""
    cache_size: int = 4096
    """Identical (reward, response, ground truth) items remembered per worker (0 = no cache)."""
    groups_per_read: int = 2
    """Rollout groups taken per read from the broker."""
    block_s: float = 1.0
    """Longest wait of one read on an empty stream."""
    publish_timeout_s: float = 5.0
    """While the scored stream is full, a worker holds its group and retries publishing every this many
    seconds (nothing is dropped)."""
    claim_stale_s: float = 60.0
    """A publish claim older than this, by a worker that never finished, is taken over; it must run out
    before the group's delivery is dead-lettered (checked at start-up)."""
    dedupe_ttl_s: float = 7 * 24 * 3600.0
    """How long group ids are remembered as scored (with transports that support expiry)."""
    publish_thread: bool = True
    """Publish and ack on a second thread (own broker connection) while the next group is graded."""
    burst: bool = False
    """Drain the rollouts stream, then exit (tests, batch re-scoring)."""
    consumer: str = ""
    """Consumer-name prefix; default <hostname>-<pid>. Worker i appends -<i>."""
    run_dir: str = "runs/reward"
    """Where this process writes its resolved config (config.reward.json, passwords as ***)."""
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = "INFO"
    """Python logging level."""
    broker: BrokerConfig = field(default_factory=lambda: BrokerConfig(claim_idle_s=30.0, max_deliveries=5))
    """The broker. claim_idle_s: a group pending this long on one (dead) worker is reclaimed by another."""
    metrics: MetricsConfig = field(default_factory=lambda: MetricsConfig(port=9101))
    """Prometheus server of worker 0; worker i serves metrics.port + i (port 0 = none)."""

    def validate(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.groups_per_read * self.group_budget_s >= self.broker.claim_idle_s:
            raise ValueError(
                f"groups_per_read * group_budget_s ({self.groups_per_read} * {self.group_budget_s})"
                f" must be below broker.claim_idle_s ({self.broker.claim_idle_s}), or groups still waiting in"
                " a worker's hands get reclaimed by another"
            )
        if self.claim_stale_s >= self.dead_letter_s:
            raise ValueError(
                f"claim_stale_s ({self.claim_stale_s}) must be below {self.dead_letter_s:.0f} s: "
                "(broker.max_deliveries - 1) * broker.claim_idle_s - groups_per_read * group_budget_s, the "
                "soonest a group held by a frozen worker's claim reaches its last delivery before it is "
                "dead-lettered"
            )
        for name in [self.default_reward, *self.routes.values()]:
            if name not in REWARDS:
                raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)}")

    @property
    def dead_letter_s(self) -> float:
        """The soonest a group whose publish claim is held by a frozen worker gets its last delivery: after
        that one it is dead-lettered. Deliveries are `claim_idle_s` apart at least; the claim is taken up to
        `groups_per_read * group_budget_s` after the first."""
        cap = self.broker.max_deliveries
        return (cap - 1) * self.broker.claim_idle_s - self.groups_per_read * self.group_budget_s

    @property
    def weights(self) -> Weights:
        return Weights(accuracy=self.accuracy_weight, format=self.format_weight)
