"""The outbox: publish once then ack, inline or on its thread; a broker error reaches the worker."""

from __future__ import annotations

import pytest

from broker.names import Names
from broker.schemas import RolloutGroup, Score
from broker.transport import Delivery, TransportError
from reward_service.metrics import RewardMetrics
from reward_service.outbox import Outbox


class MemoryTransport:
    """Just the calls the outbox makes, in memory; `fail_publish` makes publish raise."""

    def __init__(self, fail_publish: bool = False):
        self.values: dict[str, bytes] = {}
        self.published: list[tuple[str, bytes]] = []
        self.acked: list[str] = []
        self.fail_publish = fail_publish

    def get_value(self, key):
        return self.values.get(key)

    def set_value(self, key, value):
        self.values[key] = value

    def publish(self, stream, payload, *, timeout=30.0):
        if self.fail_publish:
            raise TransportError("broker down")
        self.published.append((stream, payload))
        return str(len(self.published))

    def ack(self, stream, group, ids):
        self.acked += list(ids)

    def close(self):
        pass


def _group(group_id: str) -> RolloutGroup:
    return RolloutGroup(
        group_id=group_id,
        prompt_id="p",
        data_source="geometry3k",
        prompt_token_ids=[],
        images=[],
        ground_truth="1",
        samples=[],
    )


@pytest.mark.parametrize("threaded", [False, True])
def test_each_group_is_published_once_and_acked_after(threaded):
    transport, names = MemoryTransport(), Names("t")
    outbox = Outbox(transport, names, "w", RewardMetrics(), stopping=lambda: False, threaded=threaded)
    for i, gid in enumerate(["a", "b", "a"]):
        outbox.submit(
            Delivery(names.rollouts, f"{i}-0", b""), _group(gid), [Score(reward=1, accuracy=1, format=0)]
        )
    outbox.close()
    assert len(transport.published) == 2 and transport.acked == ["0-0", "1-0", "2-0"]
    assert (outbox.published, outbox.duplicates) == (2, 1)


def test_an_error_on_the_thread_is_raised_in_the_worker():
    transport, names = MemoryTransport(fail_publish=True), Names("t")
    outbox = Outbox(transport, names, "w", RewardMetrics(), stopping=lambda: False, threaded=True)
    outbox.submit(Delivery(names.rollouts, "1-0", b""), _group("a"), [])
    with pytest.raises(TransportError):
        outbox.close()
    assert transport.acked == []
