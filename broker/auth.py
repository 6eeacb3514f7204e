"""Authenticated payloads: an HMAC-SHA256 tag with the run's message key on every stream entry.

Whoever can write to the broker (a stolen password, a misconfigured firewall) could otherwise publish
a forged `ScoredGroup` that the learner trains on. So every role of a run shares a secret message key
(`BrokerConfig.auth_key_file` or $PARALLAX_BROKER_AUTH_KEY; the launcher draws one per run), which
the broker itself never sees, and `broker.channel` seals what it publishes and opens what it consumes:

    sealed = seal(key, stream, body)      # MAGIC + HMAC-SHA256(key, stream NUL body) + body
    body = open_sealed(key, stream, sealed)   # the body, or AuthError (reason "auth")

The tag covers the stream name, so an entry copied to another stream does not verify; it is checked
before anything decodes the body. A repeated entry (a replay) verifies, and is caught where every
duplicate is: by group id (the learner's inbox, the reward service's publish-once gate).
With no key (`key=None`), `seal` returns the body as it is and `open_sealed` strips a tag unchecked:
a run without a key is a run without message authentication (its roles warn at start).
A message body is a msgpack map, whose first byte is never MAGIC's, so both kinds are told apart.
"""

from __future__ import annotations

import hashlib
import hmac

MAGIC = b"PXA1"
"""Marks a sealed payload (a msgpack map never starts with 'P')."""
TAG_BYTES = 32
HEADER_BYTES = len(MAGIC) + TAG_BYTES
AUTH = "auth"
"""The rejected-messages reason of a payload whose tag is missing or wrong."""


class AuthError(ValueError):
    """A payload without a valid tag; `reason` is AUTH."""

    reason = AUTH


def key_bytes(key: str | bytes | None) -> bytes | None:
    """The HMAC key of a configured secret (text is used as its UTF-8 bytes); None for none."""
    if not key:
        return None
    return key.encode() if isinstance(key, str) else bytes(key)


def key_of(transport) -> bytes | None:
    """The message key a transport carries (`Transport.auth_key`; None for objects without one)."""
    return getattr(transport, "auth_key", None)


def _tag(key: bytes, stream: str, body: bytes | memoryview) -> bytes:
    mac = hmac.new(key, stream.encode() + b"\0", hashlib.sha256)
    mac.update(body)
    return mac.digest()


def seal(key: bytes | None, stream: str, body: bytes) -> bytes:
    """`body` with its tag for `stream` in front (as it is without a key)."""
    if key is None:
        return body
    return MAGIC + _tag(key, stream, body) + body


def is_sealed(payload: bytes) -> bool:
    return payload[: len(MAGIC)] == MAGIC


def open_sealed(key: bytes | None, stream: str, payload: bytes) -> memoryview | bytes:
    """The body of a sealed payload after checking its tag for `stream`; AuthError when it has none or
    a wrong one. Without a key: the body, any tag stripped unchecked."""
    if not is_sealed(payload):
        if key is None:
            return payload
        raise AuthError(f"no authentication tag ({len(payload)} bytes)")
    body = memoryview(payload)[HEADER_BYTES:]
    if key is None:
        return body
    if len(payload) < HEADER_BYTES or not hmac.compare_digest(
        payload[len(MAGIC) : HEADER_BYTES], _tag(key, stream, body)
    ):
        raise AuthError(f"authentication tag does not match ({len(payload)} bytes): not from this run")
    return body
