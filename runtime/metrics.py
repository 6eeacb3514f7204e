"""Prometheus metrics plumbing shared by every process.

Each process serves its own registry on its own port (`start_metrics_server`); metric objects
are created by the role that owns them (generator/metrics.py, ...) with the `parallax_` prefix.
Port 0 disables the server.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def start_metrics_server(port: int, registry: CollectorRegistry, addr: str = "0.0.0.0") -> int:
    """Serve `registry` on `port` (0 = disabled); returns the port actually served."""
    if port <= 0:
        return 0
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server.server_port
