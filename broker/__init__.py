"""Parallax broker package: the only code that knows Redis or ZeroMQ.

`broker.connect(url, **opts)` returns a `broker.transport.Transport`:
    redis://[user]:[password]@host:port/db   -> Redis Streams (`broker.redis_transport`)
    zmq://host:port                          -> the ZeroMQ broker (`broker.zmq_transport`)
`opts` are `broker.stream_options.StreamOptions` fields (max_len, claim_idle_s, max_deliveries,
blob_ttl_s, dead_max_len) plus transport-specific ones. Typed messages: `broker.channel`.
Nothing is imported or connected until `connect` is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker.transport import Transport


def connect(url: str, **opts) -> Transport:
    """A connected transport for `url` (raises TransportError if the broker does not answer)."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        from broker.redis_transport import RedisTransport

        return RedisTransport(url, **opts)
    if url.startswith("zmq://"):
        from broker.zmq_transport import ZmqTransport

        return ZmqTransport(url, **opts)
    raise ValueError(f"unsupported broker url {url!r}: use redis://host:port/db or zmq://host:port")
