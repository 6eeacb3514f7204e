"""Typed encode/decode of Parallax wire messages (msgspec msgpack over `schemas.Message`).

`encode(msg) -> bytes` and `decode(data) -> Message`. Anything that is not a well-formed
message of a known kind at a readable schema version (`READABLE_VERSIONS`: the current
`SCHEMA_VERSION` and older ones whose messages still decode, their new fields at their defaults)
raises `MessageError`, whose `reason` is a short label ("malformed", "unknown_kind",
"unknown_version", "wrong_type") fit for a metric, and whose text says what was wrong. No pickle anywhere.
"""

from __future__ import annotations

import functools

import msgspec

from broker.schemas import READABLE_VERSIONS, SCHEMA_VERSION, Message, ScoredGroup

REASONS = ("malformed", "unknown_kind", "unknown_version", "wrong_type")
"""Every `MessageError.reason` (the `reason` label of the rejected-messages counter)."""


class MessageError(ValueError):
    """A payload that is not a valid message; `reason` is one of `REASONS`."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class _Header(msgspec.Struct):
    """Just enough of any message to say which kind and version it claims to be."""

    type: str = ""
    schema_version: int = -1


@functools.cache
def _encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


@functools.cache
def _decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(Message)


@functools.cache
def _known_kinds() -> frozenset[str]:
    return frozenset(cls.__struct_config__.tag for cls in Message.__args__)


def encode(msg: Message) -> bytes:
    """msgpack bytes of one message (a struct from `broker.schemas`)."""
    if not isinstance(msg, Message.__args__):
        raise MessageError(
            "wrong_type", f"cannot encode {type(msg).__name__}; expected one of {_kind_list()}"
        )
    return _encoder().encode(msg)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message in `data`; raises MessageError for garbage, unknown kinds and versions."""
    try:
        msg = _decoder().decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise _diagnose(data, exc) from None
    _check_version(msg)
    return msg


def _check_version(msg: Message) -> None:
    versions = [msg.schema_version]
    if isinstance(msg, ScoredGroup):
        versions.append(msg.group.schema_version)
    for version in versions:
        if version not in READABLE_VERSIONS:
            raise MessageError(
                "unknown_version", f"{type(msg).__name__} has schema_version {version}, {_speaks()}"
            )


def _diagnose(data: bytes | bytearray | memoryview, exc: Exception) -> MessageError:
    """Turn a decode failure into the most specific MessageError we can."""
    try:
        header = msgspec.msgpack.decode(data, type=_Header)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return MessageError("malformed", f"not a msgpack message map ({exc})")
    if header.type not in _known_kinds():
        return MessageError("unknown_kind", f"message kind {header.type!r} is not one of {_kind_list()}")
    if header.schema_version not in (-1, *READABLE_VERSIONS):
        return MessageError(
            "unknown_version", f"{header.type!r} has schema_version {header.schema_version}, {_speaks()}"
        )
    return MessageError("malformed", f"invalid {header.type!r} message: {exc}")


def _speaks() -> str:
    older = ", ".join(str(v) for v in READABLE_VERSIONS if v != SCHEMA_VERSION)
    return f"this build speaks {SCHEMA_VERSION}" + (f" (and reads {older})" if older else "")


def _kind_list() -> str:
    return ", ".join(sorted(_known_kinds()))
