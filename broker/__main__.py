"""`python -m broker demo | zmq-broker`.

demo        pushes realistic rollout groups through Redis Streams and the ZeroMQ broker (starting a
            local redis-server on a free port and a ZeroMQ broker process unless urls are given)
            and prints the throughput of both side by side.
zmq-broker  runs the ZeroMQ broker in the foreground (`--bind tcp://127.0.0.1:5555`).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import tyro


@dataclass
class DemoConfig:
    """`python -m broker demo`: rollout groups through both transports, with throughput."""

    redis_url: str | None = None
    """Redis to use (redis://[:password@]host:port/db); None starts a local redis-server."""
    zmq_url: str | None = None
    """ZeroMQ broker to use (zmq://host:port); None starts one as a child process."""
    groups: int = 3000
    """Rollout groups per run (8 samples x 512 tokens each)."""
    batch: int = 64
    """Groups per publish and per consume call."""
    max_len: int = 1000
    """Stream bound: the producer blocks while this many groups are unacked."""
    modes: tuple[str, ...] = ("bytes", "typed")
    """"bytes": the transport alone; "typed": msgspec encode + decode included."""


def run_demo(config: DemoConfig) -> int:
    from broker.demo import format_table, run_pipeline
    from broker.redis_server import LocalRedis
    from broker.zmq_broker import BrokerProcess

    with contextlib.ExitStack() as stack:
        servers = {}  # label -> (url, pid of the server we started, or None)
        for label, url, start in (
            ("redis", config.redis_url, LocalRedis),
            ("zmq", config.zmq_url, BrokerProcess),
        ):
            server = None if url else stack.enter_context(start())
            servers[label] = (url or server.url, server.process.pid if server else None)
        results = []
        for mode in config.modes:
            for label, (url, pid) in servers.items():
                print(f"... {label} {mode}: {config.groups} groups", flush=True)
                results.append(
                    run_pipeline(
                        url, label, mode, config.groups, config.batch, config.max_len, server_pid=pid
                    )
                )
    print(format_table(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    from broker.zmq_broker import ZmqBrokerConfig, serve_forever
    from runtime.cli_errors import one_line_errors
    from runtime.config import ConfigError

    try:
        with one_line_errors(DemoConfig, ZmqBrokerConfig):
            config = tyro.extras.subcommand_cli_from_dict(
                {"demo": DemoConfig, "zmq-broker": ZmqBrokerConfig},
                args=sys.argv[1:] if argv is None else argv,
                prog="python -m broker",
            )
    except ConfigError as exc:  # a wrong flag: one line, exit 1, as every role's
        raise SystemExit(f"error: {exc}") from None
    if isinstance(config, DemoConfig):
        return run_demo(config)
    serve_forever(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
