"""Weight sync between real processes over gloo: bit-exact round trips, membership, failures.

The learner side runs in the test process; generators are spawned processes (except where a
thread is enough) and report each delivered version with a digest of their whole model.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest
from weights_procs import (
    DyingSender,
    Net,
    announced_config,
    digest,
    dying_learner_main,
    file_resolver,
    generator_main,
    perturb,
    read_lines,
    wait_until,
)

import weights
from policy.loading import load_model
from weights.broadcast_sender import BroadcastSender
from weights.config import BroadcastTransport, WeightReceiverConfig, WeightSenderConfig
from weights.manifest import module_loader
from weights.protocol import encode

CTX = mp.get_context("spawn")


@pytest.fixture
def procs(tmp_path):
    """Start the learner and generator processes; on teardown ask them to stop, then kill what is left."""
    started = []

    def start(target, *args):
        p = CTX.Process(target=target, args=args, daemon=True)
        p.start()
        started.append(p)
        return p

    yield start
    (tmp_path / "stop").touch()
    for p in started:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join()


@pytest.fixture
def sender():
    made = []

    def make(**kwargs):
        s = weights.sender(WeightSenderConfig(transport=BroadcastTransport(**kwargs), timeout_s=10.0))
        s.start()
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _versions(out: Path, generator_id: str) -> dict[int, str]:
    return {line["version"]: line["digest"] for line in read_lines(out / f"{generator_id}.jsonl")}


def _wait_version(out: Path, generator_id: str, version: int) -> str:
    found = lambda: _versions(out, generator_id).get(version)  # noqa: E731
    return wait_until(found, what=f"{generator_id} at version {version}")


def test_round_trip_of_tiny_model_is_bit_exact_on_two_generators(tiny_model_dir, tmp_path, sender, procs):
    model = load_model(tiny_model_dir)
    perturb(model, 0.01)
    s = sender(bucket_mb=0.5)
    for gid in ("gen-a", "gen-b"):
        procs(generator_main, encode(s.announcement), gid, str(tmp_path), str(tiny_model_dir))
    wait_until(lambda: len(s.members()) == 2, what="both generators to join")
    assert digest(load_model(tiny_model_dir)) != digest(model)

    report = s.sync(model, version=1, step=1)

    assert sorted(report.sent_to) == ["gen-a", "gen-b"] and report.dropped == []
    assert report.num_bytes > 3_000_000  # ~0.8 M fp32 parameters in several buckets
    for gid in ("gen-a", "gen-b"):
        assert _wait_version(tmp_path, gid, 1) == digest(model)
    wait_until(lambda: s.members() == {"gen-a": 1, "gen-b": 1}, what="versions confirmed")


def test_killed_generator_is_dropped_and_does_not_stall_the_next_sync(tmp_path, sender, procs):
    model = Net(seed=0)
    s = sender(bucket_mb=0.002)
    announcement = encode(s.announcement)
    gens = {gid: procs(generator_main, announcement, gid, str(tmp_path)) for gid in ("gen-a", "gen-b")}
    wait_until(lambda: len(s.members()) == 2, what="both generators to join")
    assert sorted(s.sync(model, 1).sent_to) == ["gen-a", "gen-b"]
    _wait_version(tmp_path, "gen-b", 1)

    gens["gen-b"].kill()
    gens["gen-b"].join()
    perturb(model, 1.0)
    report = s.sync(model, 2)

    assert report.sent_to == ["gen-a"] and report.dropped == ["gen-b"]
    assert report.seconds < s.config.timeout_s
    assert _wait_version(tmp_path, "gen-a", 2) == digest(model)
    assert list(s.members()) == ["gen-a"]


def test_late_joiner_receives_the_current_version_without_a_new_sync(tmp_path, sender, procs):
    model = Net(seed=0)
    s = sender(bucket_mb=0.002)
    procs(generator_main, encode(s.announcement), "gen-a", str(tmp_path))
    wait_until(lambda: s.members(), what="gen-a to join")
    s.sync(model, 1)
    perturb(model, 1.0)
    s.sync(model, 2)
    current = digest(model)

    procs(generator_main, encode(s.announcement), "gen-late", str(tmp_path))

    assert _wait_version(tmp_path, "gen-late", 2) == current
    assert 1 not in _versions(tmp_path, "gen-late")
    perturb(model, 1.0)
    assert sorted(s.sync(model, 3).sent_to) == ["gen-a", "gen-late"]
    assert _wait_version(tmp_path, "gen-late", 3) == _wait_version(tmp_path, "gen-a", 3) == digest(model)


def test_without_keep_last_a_joiner_waits_for_the_next_sync(sender):
    model, target = Net(seed=0), Net(seed=5)
    s = sender(bucket_mb=0.002, keep_last=False)
    s.sync(model, 1)
    receiver = weights.receiver(announced_config(s.announcement), "gen", apply=module_loader(target)).start()
    try:
        wait_until(lambda: s.members(), what="the receiver to join")
        assert receiver.version == -1
        s.sync(model, 2)
        assert receiver.wait_for(2, timeout_s=10)
        assert receiver.stats.history == [2] and digest(target) == digest(model)
    finally:
        receiver.close()


def test_learner_dying_mid_version_leaves_old_weights_then_rejoin_gets_new(tmp_path, sender, procs):
    address_file = tmp_path / "address"
    target = Net(seed=123)
    receiver = weights.receiver(
        WeightReceiverConfig(timeout_s=3.0, retry_s=0.2),
        "gen",
        apply=module_loader(target),
        resolve=file_resolver(address_file),
    ).start()
    try:
        learner = procs(dying_learner_main, str(address_file), str(tmp_path), 0.002)
        learner.join(timeout=60)
        assert learner.exitcode == 3  # died inside version 2
        expected = json.loads((tmp_path / "learner.json").read_text())
        wait_until(lambda: receiver.stats.failures >= 1, what="the broken transfer to be noticed")

        assert receiver.version == 1 and receiver.stats.history == [1]
        assert digest(target) == expected["1"] != expected["2"]

        model = Net(seed=0)
        perturb(model, 2.0)
        s = sender(bucket_mb=0.002)
        s.sync(model, 3)
        address_file.write_bytes(encode(s.announcement))
        assert receiver.wait_for(3, timeout_s=30)
        assert receiver.stats.history == [1, 3] and digest(target) == digest(model)
    finally:
        receiver.close()


class StallingSender(DyingSender):
    """Pauses longer than the timeout after the first bucket of version `die_at`, then carries on."""

    def _launch(self, members, buf):
        works = BroadcastSender._launch(self, members, buf)
        if self._version == self.die_at and not getattr(self, "_stalled", False):
            self._stalled = True
            time.sleep(2.5 * self.config.timeout_s)
        return works


def test_stalled_transfer_times_out_keeps_old_weights_and_catches_up():
    model, target = Net(seed=0), Net(seed=5)
    s = StallingSender(WeightSenderConfig(transport=BroadcastTransport(bucket_mb=0.002), timeout_s=1.0))
    s.die_at = 2
    s.start()
    applied: list[tuple[int, str]] = []
    loader = module_loader(target)

    def apply(tensors, version):
        loader(tensors, version)
        applied.append((version, digest(target)))

    receiver = weights.receiver(announced_config(s.announcement, retry_s=0.1), "gen", apply=apply).start()
    try:
        wait_until(lambda: s.members(), what="the receiver to join")
        s.sync(model, 1)
        v1 = digest(model)
        assert receiver.wait_for(1, timeout_s=10)
        perturb(model, 1.0)

        report = s.sync(model, 2)  # the receiver gives up on it meanwhile and rejoins

        assert report.dropped == ["gen"]
        assert receiver.wait_for(2, timeout_s=20)  # caught up from the kept copy
        assert receiver.stats.failures >= 1
        assert applied == [(1, v1), (2, digest(model))]
    finally:
        receiver.close()
        s.close()
