"""broker.codec: every message kind round-trips; garbage, unknown kinds and versions are rejected."""

from __future__ import annotations

import msgspec
import pytest

from broker import codec
from broker.schemas import SCHEMA_VERSION, Sample
from tests.unit.broker.messages import every_message, rollout_group


@pytest.mark.parametrize("msg", every_message(), ids=lambda m: type(m).__name__)
def test_every_message_kind_round_trips(msg):
    data = codec.encode(msg)
    assert isinstance(data, bytes)
    assert codec.decode(data) == msg


def _as_dict(msg) -> dict:
    return msgspec.to_builtins(msg)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x92\x01",
        msgspec.msgpack.encode(5),
        msgspec.msgpack.encode("rollout_group"),
        b"{}" * 3,
    ],
    ids=["empty", "invalid-byte", "truncated", "int", "string", "json-ish"],
)
def test_garbage_is_malformed(data):
    with pytest.raises(codec.MessageError) as info:
        codec.decode(data)
    assert info.value.reason == "malformed"


def test_wrong_field_type_is_malformed_and_names_the_field():
    raw = _as_dict(rollout_group())
    raw["samples"][0]["behaviour_logprobs"] = "not a list"
    with pytest.raises(codec.MessageError, match="behaviour_logprobs") as info:
        codec.decode(msgspec.msgpack.encode(raw))
    assert info.value.reason == "malformed"


def test_missing_required_field_is_malformed():
    raw = _as_dict(rollout_group())
    del raw["group_id"]
    with pytest.raises(codec.MessageError, match="group_id") as info:
        codec.decode(msgspec.msgpack.encode(raw))
    assert info.value.reason == "malformed"


def test_unknown_kind_is_rejected():
    raw = _as_dict(rollout_group()) | {"type": "rollout_group_v9"}
    with pytest.raises(codec.MessageError, match="rollout_group_v9") as info:
        codec.decode(msgspec.msgpack.encode(raw))
    assert info.value.reason == "unknown_kind"


@pytest.mark.parametrize("msg", every_message(), ids=lambda m: type(m).__name__)
def test_unknown_schema_version_is_rejected(msg):
    raw = _as_dict(msg) | {"schema_version": SCHEMA_VERSION + 1}
    with pytest.raises(codec.MessageError, match=f"schema_version {SCHEMA_VERSION + 1}") as info:
        codec.decode(msgspec.msgpack.encode(raw))
    assert info.value.reason == "unknown_version"


def test_future_version_with_changed_fields_is_reported_as_unknown_version():
    raw = _as_dict(rollout_group()) | {"schema_version": SCHEMA_VERSION + 1, "samples": "packed-v2"}
    with pytest.raises(codec.MessageError) as info:
        codec.decode(msgspec.msgpack.encode(raw))
    assert info.value.reason == "unknown_version"


def test_nested_group_version_of_a_scored_group_is_checked():
    scored = every_message()[2]
    raw = _as_dict(scored)
    raw["group"]["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(codec.MessageError) as info:
        codec.decode(msgspec.msgpack.encode(raw))
    assert info.value.reason == "unknown_version"


def test_encoding_a_non_message_is_refused():
    sample = rollout_group().samples[0]
    assert isinstance(sample, Sample)
    with pytest.raises(codec.MessageError) as info:
        codec.encode(sample)
    assert info.value.reason == "wrong_type"
