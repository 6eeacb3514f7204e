"""One learner per run (learner/fencing.py) on both brokers: a second learner is refused, naming the holder;
a learner restarted after a crash takes over with the next epoch; a learner whose lease was stolen writes
nothing more (no publish, ack, cursor, announcement or checkpoint) and exits saying why."""

from __future__ import annotations

import json

import pytest

import broker
from broker.config import BrokerConfig
from broker.lease import Lease
from broker.transport import FencedError
from learner import fencing
from learner.config import LearnerConfig
from learner.entry import run
from learner.fencing import HELD, Holder, claim_run
from learner.trainer import Learner
from learner.wiring import NullSender
from weights.config import WeightSenderConfig


def _cfg(url, names, run_dir, model="") -> LearnerConfig:
    cfg = LearnerConfig(
        model=str(model),
        broker=BrokerConfig(url=url, namespace=names.namespace),
        run_dir=str(run_dir),
        max_steps=2,
        weight_sync=WeightSenderConfig(enabled=False),
        idle_exit_s=3.0,
    )
    cfg.algo.groups_per_step = 2
    cfg.checkpoint.every = 1
    return cfg


def _steal(url, names) -> Lease:
    """Another learner overwrites the run's lease (its holder named dead), as a takeover would."""
    thief = Lease(broker.connect(url), names.learner_lease, Holder(run_dir="elsewhere").encode(), ttl_s=30)
    transport = thief.transport
    held = transport.acquire_lease(names.learner_lease, b"probe", 30)
    assert thief.acquire(replace=held.holder).acquired
    return thief


def test_a_second_learner_of_the_run_is_refused_naming_the_holder(broker_url, names, tmp_path, monkeypatch):
    first = claim_run(_cfg(broker_url, names, tmp_path / "run"))
    monkeypatch.setattr(fencing, "LEASE_TTL_S", 0.5)  # the next ones wait less for a live holder's lease
    try:
        with pytest.raises(SystemExit) as same_dir:  # the lock file of the run directory
            claim_run(_cfg(broker_url, names, tmp_path / "run"))
        with pytest.raises(SystemExit) as other_dir:  # the broker lease: another run dir, same namespace
            claim_run(_cfg(broker_url, names, tmp_path / "other"))
    finally:
        first.release()
    for refused in (same_dir, other_dir):
        text = str(refused.value)
        assert HELD in text and "epoch 1" in text and str(tmp_path / "run") in text, text
        assert f"pid {Holder().pid}" in text and "since 20" in text, text
    lock = json.loads((tmp_path / "run" / fencing.LOCK_FILE).read_text())
    assert lock["epoch"] == 1 and lock["run_dir"] == str((tmp_path / "run").resolve())
    again = claim_run(_cfg(broker_url, names, tmp_path / "other"))  # released: the next one takes it
    assert again.lease.epoch == 2
    again.release()


def test_a_learner_restarted_after_a_crash_takes_over_with_the_next_epoch(broker_url, names, tmp_path):
    crashed = claim_run(_cfg(broker_url, names, tmp_path / "run"))
    crashed.lease._stop.set()  # dies: renews nothing more, releases nothing, its lock goes with it
    fencing.os.close(crashed.lock_fd)
    restarted = claim_run(_cfg(broker_url, names, tmp_path / "run"))  # at once: no wait for the expiry
    try:
        assert restarted.lease.epoch == crashed.lease.epoch + 1
        with pytest.raises(FencedError):  # the crashed one's writes (a frozen, not dead, process) are refused
            writer = broker.connect(broker_url)
            writer.fence = crashed.lease.fence
            writer.set_value(names.learner_version, b"stale")
    finally:
        restarted.release()
        crashed.lease.transport.close()


def test_a_learner_whose_lease_was_stolen_writes_nothing_and_stops(
    tiny_model_dir, redis_server, names, publish, tmp_path
):
    cfg = _cfg(redis_server.url, names, tmp_path, tiny_model_dir)
    cfg.checkpoint.every = 0  # only the ones the test asks for
    claim = claim_run(cfg)
    learner = Learner(cfg, sender=NullSender(), fence=claim.lease.fence)
    publish([1.0, 0.0], seed=1)
    publish([0.0, 1.0], seed=2)
    learner.train_step(learner._next_groups())  # trains one step, holds its acks for the checkpoint
    announced = learner.transport.get_value(names.learner_version)
    thief = _steal(redis_server.url, names)
    with pytest.raises(FencedError):
        learner._checkpoint()  # written, then refused before it is renamed into place
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000001.tmp"]
    assert len(learner.inbox.unacked) == 2
    with pytest.raises(FencedError):
        learner._announce()
    with pytest.raises(FencedError):
        learner.inbox.sub.ack(learner.inbox.unacked)
    assert learner.transport.get_value(names.learner_version) == announced
    assert learner.transport.pending(names.scored, "learner") == 2  # still with the run, for the next learner
    learner.fenced = True
    learner.close()  # writes nothing (no final checkpoint, no export)
    assert not (tmp_path / "hf").exists()
    claim.release()
    thief.release()


def test_run_exits_saying_the_lease_was_lost(tiny_model_dir, redis_server, names, tmp_path):
    cfg = _cfg(redis_server.url, names, tmp_path, tiny_model_dir)
    claim = claim_run(cfg)
    thief = _steal(redis_server.url, names)
    with pytest.raises(SystemExit, match="lost the run's lease"):
        run(cfg, claim)  # its first announcement is refused
    assert broker.connect(redis_server.url).get_value(names.learner_version) is None
    assert not (tmp_path / fencing.LOCK_FILE).read_text() or claim.lease.epoch == 0  # released
    thief.release()
