"""The learner's inbox against a real Redis: prompts in flight are tracked by id.

A stand-in generator answers the feeder's prompts; around the good groups it injects entries
the learner never published, a second copy of a group already consumed, and groups with a NaN
reward or a -inf behaviour logprob. Each is dead-lettered with its reason and counted, the good
groups are all trained, and the feeder's in-flight window never moves because of them.
"""

import math

import pytest

import broker
from broker.channel import Publisher, Subscriber
from broker.config import BrokerConfig
from broker.names import group_id
from broker.schemas import PromptRecord, Rollout, RolloutGroup, Score, ScoredGroup
from learner.config import LearnerConfig
from learner.feeder import PromptFeeder
from learner.inbox import Inbox


def _records(n=8):
    return [
        PromptRecord(prompt_id=f"p{i}", data_source="synthetic", problem="what?", ground_truth="1")
        for i in range(n)
    ]


def _scored(gid, prompt_id, rewards=(0.0, 1.0), logprob=-0.5, prompt_ids=(1, 2)):
    samples = [
        Rollout.of(
            token_ids=[5, 6],
            logprobs=[-0.1, logprob],
            response_text="x",
            version_start=0,
            version_end=0,
            finish_reason="stop",
        )
        for _ in rewards
    ]
    group = RolloutGroup(
        group_id=gid,
        prompt_id=prompt_id,
        data_source="synthetic",
        prompt_token_ids=list(prompt_ids),
        images=[],
        ground_truth="1",
        samples=samples,
    )
    return ScoredGroup(group=group, scores=[Score(reward=r, accuracy=r, format=1.0) for r in rewards])


@pytest.fixture
def setup(redis_server, names):
    transport = broker.connect(redis_server.url)
    cfg = LearnerConfig(broker=BrokerConfig(namespace=names.namespace))
    cfg.algo.groups_per_step, cfg.algo.max_staleness, cfg.algo.dynamic_sampling = 2, 1, False
    cfg.checkpoint.keep = 1  # acks at the first checkpoint that holds a step (test_acks_lag_... lags them)
    feeder = PromptFeeder(
        transport, names, _records(), lambda ref: b"", groups_per_step=2, max_staleness=1, shuffle=False
    )
    inbox = Inbox(transport, names, cfg, feeder=feeder)
    assert inbox.generations == 1
    prompts = Subscriber(transport, names.prompts, "generators", "gen-0", expect=PromptRecord)
    yield transport, names, inbox, feeder, prompts, Publisher(transport, names.scored)
    transport.close()


def _answer(prompts, scored, n, **kw):
    """Generate for `n` published prompts (acked); returns their group ids."""
    got = prompts.poll(count=n, block_s=0.5)
    assert len(got) == n
    prompts.ack([d for d, _ in got])
    ids = [group_id(r.prompt_id, d.id) for d, r in got]
    for (_, record), gid in zip(got, ids, strict=True):
        scored.publish(_scored(gid, record.prompt_id, **kw))
    return ids


def test_strays_duplicates_and_nonfinite_groups_are_dead_lettered_and_never_move_the_window(setup):
    transport, names, inbox, feeder, prompts, scored = setup
    inbox._feed(version=0)
    assert len(feeder.in_flight) == 4 == feeder.state.published  # ahead = B (K + 1)
    for i in range(3):  # a group for a prompt nobody published (well-formed)
        scored.publish(_scored(f"p{i}@999-{i}", f"p{i}"))
    good = _answer(prompts, scored, 2)
    step = inbox.collect(version=0)
    assert [g.group.group_id for g in step] == good
    assert feeder.state.published == 4  # the strays freed no slot: still 2 + 2 taken
    inbox.commit()
    inbox.ack_durable()

    scored.publish(_scored(good[0], "p0"))  # a second copy of a consumed group
    nan = _answer(prompts, scored, 2, rewards=(float("nan"), 1.0))
    inbox._feed(version=1)
    assert feeder.state.published == 6  # the two taken into step 1 left the window
    ok = _answer(prompts, scored, 2)
    step = inbox.collect(version=1)
    inbox.commit()
    assert [g.group.group_id for g in step] == ok
    assert inbox.skipped["unexpected"] == 3
    assert inbox.skipped["duplicate"] == 1
    assert inbox.skipped["nonfinite"] == 2
    assert set(nan) <= inbox.consumed  # came back (their slots are free), just never trained
    assert feeder.state.published == 8 and len(feeder.in_flight) == 2  # the NaN groups freed theirs
    reasons = sorted(d.reason.split(": ", 1)[1] for d in transport.dead_letters(names.scored))
    assert reasons.count("already consumed") == 1
    assert sum("non-finite reward nan" in r for r in reasons) == 2
    assert reasons.count("not published by this learner") == 3
    inbox.ack_durable()
    assert transport.pending(names.scored, names.LEARNER) == 0


def test_a_minus_infinite_behaviour_logprob_rejects_its_group_alone(setup):
    transport, names, inbox, feeder, prompts, scored = setup
    inbox._feed(version=0)
    bad = _answer(prompts, scored, 1, logprob=-math.inf)
    good = _answer(prompts, scored, 3)
    step = inbox.collect(version=0)
    inbox.commit()
    assert [g.group.group_id for g in step] == good[:2]
    assert inbox.skipped["nonfinite"] == 1 and bad[0] in inbox.consumed
    (dead,) = transport.dead_letters(names.scored)
    assert "non-finite behaviour logprob -inf" in dead.reason


def test_a_prompt_whose_image_pads_and_images_disagree_is_dead_lettered_naming_both_counts(setup):
    transport, names, inbox, feeder, prompts, scored = setup
    inbox.image_token_id = 99
    inbox._feed(version=0)
    bad = _answer(prompts, scored, 1, prompt_ids=(1, 99, 3, 99, 2))  # two pads, no image
    good = _answer(prompts, scored, 2)
    step = inbox.collect(version=0)
    inbox.commit()  # rejects, like acks, are written once the step is trained
    assert [g.group.group_id for g in step] == good
    assert inbox.skipped["malformed"] == 1 and bad[0] in inbox.consumed
    (dead,) = transport.dead_letters(names.scored)
    prompt_id = bad[0].split("@")[0]
    assert dead.reason == f"group {bad[0]}: prompt {prompt_id}: 2 image pads in the prompt ids but 0 images"


def test_a_redelivery_of_a_held_entry_is_ignored_and_acked_once(setup, redis_server):
    transport, names, inbox, feeder, prompts, scored = setup
    inbox._feed(version=0)
    ids = _answer(prompts, scored, 2)
    assert [g.group.group_id for g in inbox.collect(version=0)] == ids
    held = [d for d, _ in inbox._step]
    for delivery in held:  # the same entries come back (e.g. reclaimed) before the checkpoint
        inbox._take(delivery, _scored(group_id("x", delivery.id), "x"))
    assert inbox.skipped["redelivered"] == 2 and transport.dead_letters(names.scored) == []
    assert inbox.ack_durable() == 0  # the step was not trained (stopped in the middle): nothing acked
    assert transport.pending(names.scored, names.LEARNER) == 2
    inbox.commit()
    assert inbox.ack_durable() == 2


def test_a_forged_result_is_dead_lettered_and_the_genuine_one_is_trained(redis_server, names):
    """Someone with broker access publishes a ScoredGroup with every reward 1.0 for a prompt in flight,
    before the reward service does: it fails the run's message key, so the inbox never sees it, and the
    genuine group that arrives after it is trained, not dead-lettered as already consumed."""
    key = b"the run's message key"
    run = broker.connect(redis_server.url, auth_key=key)
    attacker = broker.connect(redis_server.url)
    try:
        cfg = LearnerConfig(broker=BrokerConfig(namespace=names.namespace))
        cfg.algo.groups_per_step, cfg.algo.max_staleness, cfg.algo.dynamic_sampling = 2, 1, False
        feeder = PromptFeeder(
            run, names, _records(), lambda ref: b"", groups_per_step=2, max_staleness=1, shuffle=False
        )
        inbox = Inbox(run, names, cfg, feeder=feeder)
        prompts = Subscriber(run, names.prompts, "generators", "gen-0", expect=PromptRecord)
        inbox._feed(version=0)
        got = prompts.poll(count=2, block_s=0.5)
        prompts.ack([d for d, _ in got])
        ids = [group_id(r.prompt_id, d.id) for d, r in got]
        for (_, record), gid in zip(got, ids, strict=True):  # the forgeries come first
            Publisher(attacker, names.scored).publish(_scored(gid, record.prompt_id, rewards=(1.0, 1.0)))
        for (_, record), gid in zip(got, ids, strict=True):
            Publisher(run, names.scored).publish(_scored(gid, record.prompt_id, rewards=(0.0, 1.0)))
        step = inbox.collect(version=0)
        assert [g.group.group_id for g in step] == ids
        assert all([s.reward for s in g.scores] == [0.0, 1.0] for g in step), "the genuine groups"
        assert inbox.sub.rejected_count("auth") == 2 and "duplicate" not in inbox.skipped
        assert all("authentication tag" in d.reason for d in run.dead_letters(names.scored))
    finally:
        run.close()
        attacker.close()


def test_acks_lag_one_checkpoint_where_the_previous_one_is_kept(setup):
    """keep >= 2: a step is acked once a second checkpoint holds it, so a learner that falls back to the
    previous checkpoint gets its groups back; a redelivery of a held-by-checkpoint group is acked later."""
    transport, names, inbox, feeder, prompts, scored = setup
    inbox.generations = 2  # what checkpoint.keep = 2 gives (ack_generations)
    inbox._feed(version=0)
    first = _answer(prompts, scored, 2)
    assert [g.group.group_id for g in inbox.collect(version=0)] == first
    inbox.commit()
    assert inbox.ack_durable() == 0  # one checkpoint holds step 1: still pending
    assert transport.pending(names.scored, names.LEARNER) == 2
    assert set(first) <= feeder.awaiting_checkpoint  # the broker's cursor still lists them
    inbox._held.clear()  # as after a restart: the entries come back as the learner's own pending ones
    restarted = broker.connect(transport.url)
    again = restarted.consume(names.scored, names.LEARNER, "learner-0", count=2, block_s=0)
    restarted.close()
    assert [d.attempts for d in again] == [2, 2]
    for delivery in again:
        inbox._take(delivery, _scored(first[0], "p0"))
    assert inbox.skipped["redelivered"] == 2 and transport.dead_letters(names.scored) == []
    inbox._feed(version=1)
    second = _answer(prompts, scored, 2)
    assert [g.group.group_id for g in inbox.collect(version=1)] == second
    inbox.commit()
    assert inbox.ack_durable() == 2  # the second checkpoint: step 1's deliveries
    assert not set(first) & feeder.awaiting_checkpoint
    assert transport.pending(names.scored, names.LEARNER) == 2  # step 2's (the redeliveries were step 1's)
