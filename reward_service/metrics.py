"""Prometheus metrics of one reward worker (names and buckets: docs/metrics.md).

Every worker process owns a registry and serves it on `metrics.port + index`
(`runtime.metrics.start_metrics_server`). Labelled series of the known data sources are created
up front so that they are exported (as 0) from the moment the server starts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from runtime.metrics import new_registry

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
)
REWARD_BUCKETS = (0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1, 1.5)


class RewardMetrics:
    """The reward service's series on their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None, data_sources: tuple[str, ...] = ()) -> None:
        self.registry = registry or new_registry()
        r = self.registry
        self.samples = Counter("parallax_reward_samples", "Samples scored", ["data_source"], registry=r)
        self.latency = Histogram(
            "parallax_reward_latency_seconds",
            "Wall time to grade one sample",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.timeouts = Counter("parallax_reward_timeouts", "Gradings that hit the hard timeout", registry=r)
        self.value = Histogram(
            "parallax_reward_value", "Reward per sample", ["data_source"], buckets=REWARD_BUCKETS, registry=r
        )
        self.accuracy = Counter(
            "parallax_reward_accuracy", "Sum of per-sample accuracy", ["data_source"], registry=r
        )
        self.duplicates = Counter(
            "parallax_reward_duplicates", "Groups skipped: group id already scored", registry=r
        )
        self.errors = Counter(
            "parallax_reward_grader_errors",
            "Gradings without a result: grader crashed or reward function raised",
            ["reason"],
            registry=r,
        )
        self.groups = Counter("parallax_reward_groups", "Scored groups published", registry=r)
        self._by_source: dict[str, tuple] = {}
        for source in data_sources:
            self._touch(source)
        for reason in ("crash", "exception"):
            self.errors.labels(reason)

    def _touch(self, data_source: str) -> tuple:
        """The labelled children of one data source (looked up once: `labels()` costs per sample)."""
        children = self._by_source.get(data_source)
        if children is None:
            children = self._by_source[data_source] = (
                self.samples.labels(data_source),
                self.value.labels(data_source),
                self.accuracy.labels(data_source),
            )
        return children

    def observe(self, data_source: str, reward: float, accuracy: float, seconds: float) -> None:
        """One scored sample."""
        samples, value, accuracy_sum = self._touch(data_source)
        samples.inc()
        value.observe(reward)
        accuracy_sum.inc(accuracy)
        self.latency.observe(seconds)
