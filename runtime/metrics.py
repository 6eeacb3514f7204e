"""Prometheus metrics plumbing shared by every process.

Each process serves its own registry (`start_metrics_server(cfg.metrics, registry, index)`);
metric objects are created by the role that owns them (generator/metrics.py, ...) with the
`parallax_` prefix. `MetricsConfig` is the `metrics` section of every role's config: the server
binds 127.0.0.1 unless `metrics.host` says otherwise (0.0.0.0 for a Prometheus on another host
or container), on `metrics.port` + the process index; port 0 disables it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry


@dataclass
class MetricsConfig:
    """Where this process serves its Prometheus metrics."""

    host: str = "127.0.0.1"
    """Address the metrics server binds: 127.0.0.1 (this host only), 0.0.0.0 (every interface: a Prometheus
    on another host or container scrapes it) or one interface's address."""
    port: int = 0
    """Base port: process i of a role (reward worker, generator engine) serves port + i; 0 = no server."""

    def validate(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.host:
            raise ValueError("host must not be empty (127.0.0.1 = this host only, 0.0.0.0 = every interface)")


def new_registry() -> CollectorRegistry:
    from prometheus_client import CollectorRegistry

    return CollectorRegistry(auto_describe=True)


def start_metrics_server(cfg: MetricsConfig, registry: CollectorRegistry, index: int = 0) -> int:
    """Serve `registry` on cfg.host, port cfg.port + index (port 0 = disabled); returns the port served."""
    from prometheus_client import start_http_server

    if cfg.port <= 0:
        return 0
    server, _thread = start_http_server(cfg.port + index, addr=cfg.host, registry=registry)
    return server.server_port
