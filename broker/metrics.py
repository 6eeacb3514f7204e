"""The broker's Prometheus series, on the registry of the process that uses the broker.

docs/metrics.md (section Broker) is the contract:
  * `parallax_broker_rejected_total{stream,reason}`: payloads a subscriber dead-lettered (the
    codec's reasons; "auth": no valid tag of the run's message key; "oversize": above
    max_entry_bytes), and entries the transport dead-lettered past the redelivery cap while the
    subscriber consumed (`redelivery_cap`);
  * `parallax_broker_stream_backlog{stream}`: `Transport.backlog(stream)` of each consumed stream;
  * `parallax_broker_stream_waiting{stream}`: entries of a stream that no consumer of its group has taken yet
    (backlog minus the group's pending entries): the learner exports it for the prompts (generators) and
    the rollouts (reward service), what an autoscaler sizes those roles by (`watch_pipeline`);
  * `parallax_broker_backlog_errors_total`: backlog reads that failed at scrape time.

`watch(registry, transport, stream)` is all a process needs (`broker.channel.Subscriber` calls it
for the stream it consumes): it pre-creates the rejected counter of every reason (`REASONS`) for that
stream, so the series are scraped at 0 from the start, and adds the stream to the registry's
`BacklogCollector`. That collector reads the backlogs when Prometheus scrapes, at most once per
`cache_s`; a failed read is counted, logged at debug level and keeps the last value, so a broker
hiccup never fails a scrape. One set of series per registry; nothing is created at import time.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from broker import codec
from broker.auth import AUTH
from broker.stream_options import OVERSIZE
from broker.transport import Transport

log = logging.getLogger(__name__)

REDELIVERY_CAP = "redelivery_cap"
"""Reason of entries dead-lettered because they were delivered `max_deliveries` times unacked."""
REASONS = (*codec.REASONS, AUTH, OVERSIZE, REDELIVERY_CAP)
"""Every `reason` label of `parallax_broker_rejected_total`."""
BACKLOG = "parallax_broker_stream_backlog"
BACKLOG_HELP = "Entries of a consumed stream not yet acked by every group (Transport.backlog)"
WAITING = "parallax_broker_stream_waiting"
WAITING_HELP = (
    "Entries of a stream that no consumer of its group took yet (backlog minus the group's pending)"
)
CACHE_S = 2.0
"""Longest a scrape reuses backlogs read by an earlier scrape."""


class BacklogCollector(Collector):
    """Exports `parallax_broker_stream_backlog{stream}` for the watched streams, and
    `parallax_broker_stream_waiting{stream}` for those watched with their consumer group, read at scrape
    time."""

    def __init__(
        self, errors: Counter, *, cache_s: float = CACHE_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.errors = errors
        self.cache_s = cache_s
        self.clock = clock
        self._transports: dict[str, tuple[Transport, str | None]] = {}
        self._values: dict[str, int] = {}
        self._waiting: dict[str, int] = {}
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def watch(self, stream: str, transport: Transport, group: str | None = None) -> None:
        """Export the backlog of `stream` as read through `transport` (the latest call wins); with `group`,
        also the entries waiting for that group's consumers."""
        with self._lock:
            if group is None and stream in self._transports:
                group = self._transports[stream][1]
            self._transports[stream] = (transport, group)
            self._read_at = float("-inf")  # the next scrape reads the new stream

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The family without samples (so that registering never reads the broker)."""
        yield GaugeMetricFamily(BACKLOG, BACKLOG_HELP, labels=["stream"])
        yield GaugeMetricFamily(WAITING, WAITING_HELP, labels=["stream"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            if self.clock() - self._read_at >= self.cache_s:
                self._refresh()
            family = GaugeMetricFamily(BACKLOG, BACKLOG_HELP, labels=["stream"])
            for stream, value in sorted(self._values.items()):
                family.add_metric([stream], value)
            waiting = GaugeMetricFamily(WAITING, WAITING_HELP, labels=["stream"])
            for stream, value in sorted(self._waiting.items()):
                waiting.add_metric([stream], value)
        yield family
        yield waiting

    def _refresh(self) -> None:
        for stream, (transport, group) in self._transports.items():
            try:
                self._values[stream] = int(transport.backlog(stream))
                if group is not None:
                    self._waiting[stream] = max(
                        0, self._values[stream] - int(transport.pending(stream, group))
                    )
            except Exception as exc:  # a scrape must never fail because the broker did
                self.errors.inc()
                log.debug("backlog of %s not read: %s", stream, exc)
        self._read_at = self.clock()


class BrokerMetrics:
    """The broker's series on one registry (get it with `broker_metrics(registry)`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.rejected = Counter(
            "parallax_broker_rejected",
            "Messages rejected by a subscriber and dead-lettered, by stream and reason",
            ["stream", "reason"],
            registry=registry,
        )
        self.backlog_errors = Counter(
            "parallax_broker_backlog_errors", "Backlog reads that failed at scrape time", registry=registry
        )
        self.backlog = BacklogCollector(self.backlog_errors)
        registry.register(self.backlog)

    def watch(self, transport: Transport, stream: str) -> None:
        """Export the rejected counters (at 0) and the backlog of a stream this process consumes."""
        for reason in REASONS:
            self.rejected.labels(stream=stream, reason=reason)
        self.backlog.watch(stream, transport)


_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, BrokerMetrics] = weakref.WeakKeyDictionary()
_by_registry_lock = threading.Lock()


def broker_metrics(registry: CollectorRegistry) -> BrokerMetrics:
    """The broker's series on `registry`, created on first use."""
    with _by_registry_lock:
        metrics = _by_registry.get(registry)
        if metrics is None:
            metrics = _by_registry[registry] = BrokerMetrics(registry)
        return metrics


def rejected_counter(registry: CollectorRegistry) -> Counter:
    """`parallax_broker_rejected_total{stream,reason}` on `registry` (created once per registry)."""
    return broker_metrics(registry).rejected


def watch_pipeline(registry: CollectorRegistry, transport: Transport, names) -> None:
    """Export the backlog and the waiting entries of the prompts (for the generators) and the rollouts (for
    the reward service) on `registry`: what the learner exports for autoscalers (docs/scaling.md)."""
    collector = broker_metrics(registry).backlog
    collector.watch(names.prompts, transport, names.GENERATORS)
    collector.watch(names.rollouts, transport, names.REWARD)


def watch(registry: CollectorRegistry, transport: Transport, stream: str) -> BrokerMetrics:
    """Export the broker's series of `stream` (consumed through `transport`) on `registry`."""
    metrics = broker_metrics(registry)
    metrics.watch(transport, stream)
    return metrics
