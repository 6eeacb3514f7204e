"""Parallax broker package: the only code that knows Redis or ZeroMQ.

`broker.connect(url, **opts)` returns a `broker.transport.Transport`:
    redis://[user]:[password]@host:port/db   -> Redis Streams (`broker.redis_transport`)
    zmq://host:port                          -> the ZeroMQ broker (`broker.zmq_transport`)
`opts` are `broker.stream_options.StreamOptions` fields (max_len, claim_idle_s, max_deliveries,
blob_ttl_s, dead_max_len, max_entry_bytes, ...) plus transport-specific ones, and `auth_key`: the
run's message key (`Transport.auth_key`, broker/auth.py). Typed messages: `broker.channel`.
Nothing is imported or connected until `connect` is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker.transport import Transport


def connect(url: str, *, auth_key: str | bytes | None = None, **opts) -> Transport:
    """A connected transport for `url` (raises TransportError if the broker does not answer)."""
    from broker.auth import key_bytes

    if url.startswith(("redis://", "rediss://", "unix://")):
        from broker.redis_transport import RedisTransport

        transport = RedisTransport(url, **opts)
    elif url.startswith("zmq://"):
        from broker.zmq_transport import ZmqTransport

        transport = ZmqTransport(url, **opts)
    else:
        raise ValueError(f"unsupported broker url {url!r}: use redis://host:port/db or zmq://host:port")
    transport.auth_key = key_bytes(auth_key)
    return transport
