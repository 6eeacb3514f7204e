"""Prometheus series of multi-turn episodes (generator/episodes.py), on the generator's registry.

parallax_generator_episode_turns            histogram: model turns per episode
parallax_generator_episode_tokens           histogram: response tokens per episode, images expanded
parallax_generator_episode_images           histogram: images the environment added per episode
parallax_generator_tool_calls_total         counter: tool calls the model made
parallax_generator_tool_errors_total{kind}  counter: calls refused, by kind (envs/crop.py lists them)
parallax_generator_env_failures_total{reason} counter: episodes failed by their environment (timeout,
                                            error)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

TURN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 16)
TOKEN_BUCKETS = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
IMAGE_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
TOOL_ERRORS = (
    "malformed",
    "unknown_tool",
    "bad_arguments",
    "out_of_range",
    "too_small",
    "too_many_calls",
    "too_many_images",
)
"""The crop tool's error kinds (exported at 0 from the start; other environments add their own)."""


class EpisodeMetrics:
    """The series above; `observe` records one finished episode."""

    def __init__(self, registry: CollectorRegistry):
        r = registry
        self.turns = Histogram(
            "parallax_generator_episode_turns", "Model turns per episode", buckets=TURN_BUCKETS, registry=r
        )
        self.tokens = Histogram(
            "parallax_generator_episode_tokens",
            "Response tokens per episode (model and environment, images expanded)",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.images = Histogram(
            "parallax_generator_episode_images",
            "Images the environment added per episode",
            buckets=IMAGE_BUCKETS,
            registry=r,
        )
        self.tool_calls = Counter("parallax_generator_tool_calls", "Tool calls the model made", registry=r)
        self.tool_errors = Counter(
            "parallax_generator_tool_errors", "Tool calls refused, by kind", ["kind"], registry=r
        )
        self.env_failures = Counter(
            "parallax_generator_env_failures", "Episodes failed by their environment, by reason", ["reason"],
            registry=r,
        )  # fmt: skip
        for kind in TOOL_ERRORS:
            self.tool_errors.labels(kind)
        for reason in ("timeout", "error"):
            self.env_failures.labels(reason)

    def observe(self, episode) -> None:
        """Record a finished `generator.episodes.Episode`."""
        self.turns.observe(len(episode.versions))
        self.tokens.observe(episode.length)
        self.images.observe(len(episode.crops))
        self.tool_calls.inc(episode.calls)
        for kind in episode.error_kinds:
            self.tool_errors.labels(kind).inc()
        if episode.failure is not None:
            self.env_failures.labels(episode.failure.reason).inc()
