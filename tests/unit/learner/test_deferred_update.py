"""optim.defer_update: a step's last host AdamW held back to the next step, beside that step's KL pass.

The held update must be the same update (the fp32 master weights and every step's loss metrics agree with
the update at once), its weights published before the next step trains, and never later than without it:
when the next step's groups are not all waiting, or a checkpoint needs the weights, it runs at once.
"""

import dataclasses
import time

import pytest
import torch

import learner.update as update
from learner.inbox import NOT_READY
from learner.trainer import Learner
from tests.unit.learner.test_trainer import CallOrder, _cfg

KW = {"optim.master_weights": "host", "loss.kl_coef": 0.1, "checkpoint.every": 0, "algo.max_staleness": 4}


def _learner(tiny_model_dir, redis_server, names, run_dir, defer: bool, **kw) -> Learner:
    cfg = _cfg(tiny_model_dir, redis_server, names, run_dir, **(KW | kw))
    cfg.optim.defer_update = defer
    sender = CallOrder()
    learner = Learner(cfg, sender=sender)
    learner.updater.overlap_ref = True  # on for host AdamW on a GPU; forced on this CPU
    micro_step = learner.updater.micro_step

    def traced(*args, **kwargs):
        if not sender.calls or sender.calls[-1] != "train":
            sender.calls.append("train")
        return micro_step(*args, **kwargs)

    learner.updater.micro_step = traced
    return learner


def _record_beside(monkeypatch) -> list[bool]:
    """Whether each AdamW ran with a KL pass beside it."""
    works, step_beside = [], update.step_beside

    def record(optimizer, work=None):
        works.append(work is not None)
        return step_beside(optimizer, work)

    monkeypatch.setattr(update, "step_beside", record)
    return works


def _masters(learner: Learner) -> list[torch.Tensor]:
    return [learner.optimizer.state[p]["master"] for p in learner.model.parameters() if p.requires_grad]


def test_the_held_update_is_the_same_update_published_before_the_next_step_trains(
    tiny_model_dir, redis_server, names, publish, tmp_path, monkeypatch
):
    for step in range(3):
        for seed in range(2):
            publish([1.0, 0.0] if seed else [0.0, 1.0], seed=10 * step + seed, version=step)
    at_once = _learner(tiny_model_dir, redis_server, names, tmp_path / "at_once", defer=False)
    held = _learner(tiny_model_dir, redis_server, names, tmp_path / "held", defer=True)
    steps = [at_once._next_groups() for _ in range(3)]
    works = _record_beside(monkeypatch)

    values = [at_once.train_step(groups) for groups in steps]
    assert works == [False] * 3 and at_once.updater.pending is None
    assert at_once.sender.calls == ["train", "begin_write", "sync"] * 3
    works.clear()
    held_values = []
    for n, groups in enumerate(steps):
        held_values.append(held.train_step(groups))
        # each step trains, then holds its AdamW; the next one first runs it, then publishes, then trains
        assert held.sender.calls == ["train"] + ["begin_write", "sync", "train"] * n
        assert held.updater.pending is not None and held.state.version == n
    held._finish_held_update(held._carried)
    assert held.updater.pending is None and held.state.version == 3
    assert held.sender.calls[-2:] == ["begin_write", "sync"]
    assert works == [
        True,
        True,
        False,
    ]  # the KL passes of steps 2 and 3 beside the held AdamW; the last alone

    for a, b in zip(_masters(at_once), _masters(held), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    for a, b in zip(values, held_values, strict=True):
        for key in ("kl_ref", "ratio_mean", "clipped_frac", "grad_norm", "tokens", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-6), key
    assert held_values[1]["optimizer_s"] > 0 and held_values[0].get("optimizer_s", 0.0) == 0  # where it ran
    for learner in (at_once, held):
        learner.close()


def test_train_holds_only_while_the_next_groups_wait(
    tiny_model_dir, redis_server, names, publish, tmp_path, monkeypatch
):
    """Two steps' groups waiting: the first step's AdamW runs beside the second's KL pass. Then nothing
    waits (a synchronous pipeline, K = 0, where the generator needs these weights to go on): the held update
    runs at once and its weights go out before the learner waits."""
    for seed in range(4):
        publish([1.0, 0.0] if seed % 2 else [0.0, 1.0], seed=seed)
    learner = _learner(tiny_model_dir, redis_server, names, tmp_path, defer=True, max_steps=3)
    works = _record_beside(monkeypatch)
    published = []
    maybe_sync = learner._maybe_sync

    def sync_then_note() -> float:
        seconds = maybe_sync()
        published.append((learner.state.version, time.monotonic()))
        return seconds

    learner._maybe_sync = sync_then_note
    steps = []
    log_step = learner.metrics.log_step
    learner.metrics.log_step = lambda values: (steps.append(values), log_step(values))
    learner.train()  # steps 1 and 2, then no third step's groups within idle_exit_s (3 s)
    ended = time.monotonic()
    assert learner.state.step == 2 and learner.updater.pending is None and learner.state.version == 2
    assert works == [True, False]  # step 1's AdamW beside step 2's KL pass; step 2's alone, before waiting
    assert [version for version, _ in published] == [1, 2]
    assert ended - published[-1][1] > 2.5  # version 2 went out before the learner waited for groups
    assert [s["update_held"] for s in steps] == [1.0, 1.0]
    assert "update_settled_alone" not in steps[1]  # step 1's ran beside step 2's KL pass
    assert learner._carried["update_settled_alone"] == 1.0  # step 2's alone: a third step would say so
    learner.close()


def test_collect_without_waiting_keeps_what_it_took(tiny_model_dir, redis_server, names, publish, tmp_path):
    learner = _learner(tiny_model_dir, redis_server, names, tmp_path, defer=True)
    publish([1.0, 0.0], seed=1)
    assert learner.inbox.collect(0, wait=False) is NOT_READY  # one of the step's two groups
    assert learner._next_groups(wait=False) is NOT_READY
    second = publish([0.0, 1.0], seed=2)
    groups = learner.inbox.collect(0, wait=False)
    assert groups is not NOT_READY and [g.group.prompt_id for g in groups] == ["p1", "p2"]
    assert groups[1].group.group_id == second.group.group_id
    learner.close()


def test_a_due_checkpoint_saves_the_steps_own_weights(
    tiny_model_dir, redis_server, names, publish, tmp_path, monkeypatch
):
    for seed in range(2):
        publish([1.0, 0.0] if seed else [0.0, 1.0], seed=seed)
    learner = _learner(tiny_model_dir, redis_server, names, tmp_path, defer=True, **{"checkpoint.every": 1})
    learner.train_step(learner._next_groups())
    assert learner.updater.pending is None and learner.state.version == 1  # settled before the checkpoint
    assert learner.sender.calls == ["train", "begin_write", "sync"]
    learner.close()


def test_off_on_the_cpu_and_where_asked(tiny_model_dir, redis_server, names, tmp_path):
    learner = _learner(tiny_model_dir, redis_server, names, tmp_path / "on", defer=True)
    assert learner._may_hold()
    k, learner.cfg.algo.max_staleness = learner.cfg.algo.max_staleness, 0
    assert not learner._may_hold()  # K = 0: the next step's groups wait for this step's weights
    learner.cfg.algo.max_staleness = k
    learner.updater.overlap_ref = False  # what a CPU learner has: its AdamW runs on the CPU the passes use
    assert not learner._may_hold()
    learner.close()
    off = _learner(tiny_model_dir, redis_server, names, tmp_path / "off", defer=False)
    assert not off._may_hold()
    off.close()


def test_a_one_rank_process_group_still_holds(tiny_model_dir, redis_server, names, tmp_path):
    """A one-GPU learner runs in a one-rank process group (FSDP2 needs one; learner.parallel): the world
    size decides, not whether a group is up (were it the latter, a one-GPU learner would never hold)."""
    from broker.redis_server import free_port

    learner = _learner(tiny_model_dir, redis_server, names, tmp_path / "group", defer=True)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        assert learner._may_hold()
        learner.info = dataclasses.replace(learner.info, world_size=2)  # two ranks: their AdamW at once
        assert not learner._may_hold()
    finally:
        torch.distributed.destroy_process_group()
    learner.close()
