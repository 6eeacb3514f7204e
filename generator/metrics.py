"""Prometheus metrics of one generator engine process (names and buckets: docs/metrics.md).

Every series exists (at 0) from construction, so a scrape right after start sees all of them.
Tokens/s and groups/s are the rates of the two counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from generator.inputs import REASONS
from runtime.metrics import new_registry

WEIGHT_LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GeneratorMetrics:
    """The generator's series on their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or new_registry()
        r = self.registry
        self.tokens = Counter(
            "parallax_generator_tokens", "Response tokens generated (train and eval)", registry=r
        )
        self.groups = Counter("parallax_generator_groups", "Rollout groups published", registry=r)
        self.queue_depth = Gauge(
            "parallax_generator_queue_depth",
            "Prompts admitted to the engine and not finished (waiting + running)",
            registry=r,
        )
        self.served_version = Gauge(
            "parallax_generator_served_version", "Policy version the engine serves", registry=r
        )
        self.blocked = Counter(
            "parallax_generator_staleness_blocked_seconds",
            "Seconds the staleness gate held back a prompt that was ready to start",
            registry=r,
        )
        self.weight_load = Histogram(
            "parallax_generator_weight_load_seconds",
            "One weight update, received version to new version served",
            buckets=WEIGHT_LOAD_BUCKETS,
            registry=r,
        )
        self.inflight_updates = Counter(
            "parallax_generator_inflight_updates",
            "Weight updates applied with sequences running (weight_update = inflight)",
            registry=r,
        )
        self.rejected = Counter(
            "parallax_generator_rejected_prompts",
            "Prompts rejected before generation, by reason",
            ["reason"],
            registry=r,
        )
        for reason in REASONS:
            self.rejected.labels(reason)

    def value(self, name: str, **labels) -> float:
        """Current value of an exported sample (tests and logs)."""
        return self.registry.get_sample_value(name, labels or None) or 0.0
