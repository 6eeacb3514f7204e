"""Schema version 3: a multi-turn episode's fields round-trip, and version 2 messages still decode."""

from __future__ import annotations

import msgspec
import pytest

from broker import codec
from broker.schemas import ImageRef, Rollout
from tests.unit.broker.messages import every_message, rollout_group

NEW_FIELDS = (
    "loss_mask_u8",
    "images",
    "turn_versions",
    "tool_calls",
    "tool_errors",
    "env_reward",
    "env_error",
)


def episode() -> Rollout:
    return Rollout.of(
        token_ids=[5, 6, 151_655, 7, 8],
        logprobs=[-0.1, -0.2, 0.0, 0.0, -0.3],
        loss_mask=[1, 1, 0, 0, 1],
        response_text="crop then answer",
        version_start=3,
        version_end=4,
        finish_reason="stop",
        images=[ImageRef(sha256="ab" * 32, width=64, height=48, nbytes=10)],
        turn_versions=[3, 4],
        tool_calls=1,
        tool_errors=0,
        env_reward=0.25,
    )


def test_an_episode_round_trips_with_its_mask_images_and_turn_versions():
    group = rollout_group()
    group.samples = [episode(), *group.samples]
    back = codec.decode(codec.encode(group)).samples[0]
    assert back == group.samples[0] and back.multi_turn
    assert back.loss_mask().tolist() == [1, 1, 0, 0, 1]
    assert back.turn_versions == [3, 4] and back.images[0].width == 64 and back.env_reward == 0.25
    assert not group.samples[1].multi_turn and group.samples[1].loss_mask().tolist() == [1] * 8


@pytest.mark.parametrize("index", [1, 2], ids=["RolloutGroup", "ScoredGroup"])
def test_a_version_2_message_still_decodes_as_one_turn_samples(index):
    raw = msgspec.msgpack.decode(codec.encode(every_message()[index]))
    group = raw if index == 1 else raw["group"]
    for sample in group["samples"]:
        for name in NEW_FIELDS:
            sample.pop(name, None)
    group["schema_version"] = 2
    raw["schema_version"] = 2
    msg = codec.decode(msgspec.msgpack.encode(raw))
    samples = msg.samples if index == 1 else msg.group.samples
    assert samples and all(not s.multi_turn and s.turn_versions == [] and s.env_error == "" for s in samples)


def test_a_mask_that_does_not_cover_the_response_is_malformed():
    raw = msgspec.msgpack.decode(codec.encode(rollout_group()))
    raw["samples"][0]["loss_mask_u8"] = b"\x01"
    with pytest.raises(codec.MessageError, match="loss mask") as info:
        codec.decode(msgspec.msgpack.encode(raw))
    assert info.value.reason == "malformed"
