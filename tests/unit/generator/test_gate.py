"""The staleness gate: min_version admission, the learner-lag bound, blocking and release, stop."""

from __future__ import annotations

import threading

import pytest

from broker import codec
from broker.schemas import PromptRecord, WeightVersion
from broker.transport import TransportError
from generator.gate import StalenessGate, VersionReader


def record(min_version: int = 0, split: str = "train", pid: str = "p") -> PromptRecord:
    return PromptRecord(
        prompt_id=pid,
        data_source="synthetic",
        problem="<image> q",
        ground_truth="1",
        min_version=min_version,
        split=split,
    )


class Versions:
    def __init__(self, served: int = 0, learner: int | None = None):
        self.served, self.learner = served, learner


def gate_for(v: Versions, **kw) -> StalenessGate:
    return StalenessGate(served=lambda: v.served, learner=lambda: v.learner, poll_s=0.001, **kw)


def test_min_version_blocks_until_the_engine_serves_it():
    v = Versions(served=2)
    gate = gate_for(v)
    assert gate.refusal(record(2)) is None
    assert gate.refusal(record(3)) == "min_version"
    polls = []

    def weights_arrive():  # what the worker does while waiting: apply received weights
        polls.append(v.served)
        if len(polls) == 5:
            v.served = 3

    blocked = []
    gate.on_blocked = blocked.append
    assert gate.wait(record(3), while_waiting=weights_arrive)
    assert len(polls) == 5 and v.served == 3
    assert gate.blocked_s > 0 and sum(blocked) == pytest.approx(gate.blocked_s)


def test_an_admitted_record_does_not_wait():
    gate = gate_for(Versions(served=1))
    calls = []
    assert gate.wait(record(1), while_waiting=lambda: calls.append(1))
    assert calls == []


def test_k0_is_synchronous_and_eval_prompts_are_exempt():
    v = Versions(served=4, learner=5)
    gate = gate_for(v, max_staleness=0)
    assert gate.refusal(record(0)) == "max_staleness"
    assert gate.refusal(record(0, split="test")) is None
    v.served = 5
    assert gate.refusal(record(0)) is None


def test_max_staleness_allows_k_versions_of_lag():
    v = Versions(served=3, learner=5)
    assert gate_for(v, max_staleness=2).refusal(record(0)) is None
    assert gate_for(v, max_staleness=1).refusal(record(0)) == "max_staleness"
    assert gate_for(v, max_staleness=-1).refusal(record(0)) is None  # off
    v.learner = None  # no learner known (dead before announcing anything): only min_version applies
    assert gate_for(v, max_staleness=0).refusal(record(0)) is None


def test_split_keeps_order_and_pairs():
    gate = gate_for(Versions(served=1))
    items = [("d0", record(0, pid="a")), ("d1", record(2, pid="b")), ("d2", record(1, pid="c"))]
    admitted, held = gate.split(items)
    assert [r.prompt_id for _, r in admitted] == ["a", "c"]
    assert [r.prompt_id for _, r in held] == ["b"]


def test_stop_and_timeout_end_a_wait_on_a_dead_learner():
    gate = gate_for(Versions(served=0))
    stop = threading.Event()
    assert not gate.wait(record(1), while_waiting=stop.set, stop=stop)
    assert not gate.wait(record(1), timeout_s=0.01)
    assert gate.blocked_s > 0


class FakeValues:
    def __init__(self):
        self.values, self.reads, self.fail = {}, 0, False

    def get_value(self, key):
        self.reads += 1
        if self.fail:
            raise TransportError("broker down")
        return self.values.get(key)


def test_version_reader_decodes_caches_and_tolerates_garbage():
    t = FakeValues()
    reader = VersionReader(t, "ns:version:learner", ttl_s=0.0)
    assert reader() is None
    t.values["ns:version:learner"] = codec.encode(WeightVersion(version=7, source="learner"))
    assert reader() == 7
    t.fail = True
    assert reader() == 7  # broker hiccup: keep the last known value
    t.fail = False
    t.values["ns:version:learner"] = b"\x00garbage"
    assert reader() is None
    cached = VersionReader(t, "ns:version:learner", ttl_s=3600.0)
    t.values["ns:version:learner"] = codec.encode(WeightVersion(version=9))
    reads = t.reads
    assert cached() == 9 and cached() == 9 and t.reads == reads + 1
