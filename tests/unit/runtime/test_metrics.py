"""runtime.metrics: the Prometheus server binds loopback unless `metrics.host` says otherwise."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

import pytest

from runtime.config import from_dict
from runtime.metrics import MetricsConfig, new_registry, start_metrics_server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_address(port: int) -> str:
    """The local address of the TCP socket listening on `port` (from /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        hex_ip, hex_port = local.split(":")
        if int(hex_port, 16) == port and state == "0A":  # 0A = LISTEN
            return socket.inet_ntoa(bytes.fromhex(hex_ip)[::-1])
    raise AssertionError(f"nothing listens on {port}")


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc/net/tcp")
@pytest.mark.parametrize("host", [None, "0.0.0.0"])
def test_the_server_binds_loopback_by_default_and_the_configured_host_otherwise(host):
    cfg = MetricsConfig(port=free_port()) if host is None else MetricsConfig(host=host, port=free_port())
    served = start_metrics_server(cfg, new_registry(), index=0)
    assert served == cfg.port
    assert listening_address(served) == ("127.0.0.1" if host is None else host)
    with urllib.request.urlopen(f"http://127.0.0.1:{served}/metrics", timeout=5) as r:
        assert r.status == 200


def test_port_zero_serves_nothing_and_bad_ports_are_refused():
    assert start_metrics_server(MetricsConfig(port=0), new_registry(), index=3) == 0
    with pytest.raises(ValueError, match="port must be in 0..65535"):
        from_dict(MetricsConfig, {"port": 70000})
