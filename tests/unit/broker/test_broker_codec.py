"""broker.codec: every message kind round-trips; garbage, unknown kinds and versions are rejected."""

from __future__ import annotations

import msgspec
import pytest

from broker import codec
from broker.schemas import SCHEMA_VERSION, Rollout
from tests.unit.broker.messages import every_message, rollout_group


@pytest.mark.parametrize("msg", every_message(), ids=lambda m: type(m).__name__)
def test_every_message_kind_round_trips(msg):
    data = codec.encode(msg)
    assert isinstance(data, bytes)
    assert codec.decode(data) == msg


def _as_dict(msg) -> dict:
    """The message as the plain msgpack map it travels as (bytes stay bytes)."""
    return msgspec.msgpack.decode(codec.encode(msg))


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
    raw["samples"][0]["behaviour_logprobs_f32"] = [-0.5, -0.25]
    with pytest.raises(codec.MessageError, match="behaviour_logprobs_f32") as info:
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


def _version_1(raw: dict) -> dict:
    """`raw` (a rollout group map) as schema version 1 wrote it: token ids and logprobs as lists."""
    for sample in raw["samples"]:
        sample["response_token_ids"] = list(range(len(sample.pop("response_token_ids_i32")) // 4))
        sample["behaviour_logprobs"] = [-0.5] * len(sample["response_token_ids"])
        del sample["behaviour_logprobs_f32"]
    return raw | {"schema_version": 1}


def test_a_version_1_group_is_rejected_with_a_clear_error():
    assert SCHEMA_VERSION == 3
    old = _version_1(_as_dict(rollout_group()))
    with pytest.raises(
        codec.MessageError, match="schema_version 1, this build speaks 3 \\(and reads 2\\)"
    ) as info:
        codec.decode(msgspec.msgpack.encode(old))
    assert info.value.reason == "unknown_version"
    scored = _as_dict(every_message()[2])
    scored = scored | {"group": _version_1(scored["group"]), "schema_version": 1}
    with pytest.raises(codec.MessageError, match="ScoredGroup|scored_group") as info:
        codec.decode(msgspec.msgpack.encode(scored))
    assert info.value.reason == "unknown_version"


def test_samples_travel_packed_and_read_back_as_arrays():
    sample = Rollout.of(
        token_ids=[5, 151_000, 7],
        logprobs=[-0.1, -2.5, 0.0],
        response_text="r",
        version_start=1,
        version_end=2,
        finish_reason="stop",
    )
    assert sample.num_tokens == 3 and len(sample.response_token_ids_i32) == 12
    group = rollout_group()
    group.samples = [sample]
    back = codec.decode(codec.encode(group)).samples[0]
    assert back == sample
    assert back.token_ids().tolist() == [5, 151_000, 7]
    assert back.logprobs().tolist() == pytest.approx([-0.1, -2.5, 0.0], abs=1e-7)  # float32 on the wire


def test_ids_and_logprobs_that_do_not_pair_up_are_malformed():
    raw = _as_dict(rollout_group())
    raw["samples"][1]["behaviour_logprobs_f32"] = raw["samples"][1]["behaviour_logprobs_f32"][:-4]
    with pytest.raises(codec.MessageError, match="do not pair up") as info:
        codec.decode(msgspec.msgpack.encode(raw))
    assert info.value.reason == "malformed"
    with pytest.raises(TypeError, match="Rollout.of"):
        Rollout(
            response_token_ids_i32=[1, 2, 3, 4],
            behaviour_logprobs_f32=[0.0] * 4,
            response_text="",
            version_start=0,
            version_end=0,
            finish_reason="stop",
        )


def test_nested_group_version_of_a_scored_group_is_checked():
    scored = every_message()[2]
    raw = _as_dict(scored)
    raw["group"]["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(codec.MessageError) as info:
        codec.decode(msgspec.msgpack.encode(raw))
    assert info.value.reason == "unknown_version"


def test_encoding_a_non_message_is_refused():
    sample = rollout_group().samples[0]
    assert isinstance(sample, Rollout)
    with pytest.raises(codec.MessageError) as info:
        codec.encode(sample)
    assert info.value.reason == "wrong_type"
