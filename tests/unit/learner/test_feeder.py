"""Prompt feeder (cursor, admission min_version, images, resume) and evaluation rounds, on Redis."""

import io

import pytest
from PIL import Image

import broker
from broker.channel import Subscriber
from broker.images import ImageStore
from broker.names import group_id
from broker.schemas import PromptRecord, Rollout, RolloutGroup, Score, ScoredGroup
from learner.config import EvalConfig
from learner.evaluation import Evaluator
from learner.feeder import PromptFeeder, admission_min_version, eval_prompt_id, eval_round_of
from tasks.records import image_ref


def _png(colour):
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def data():
    blobs, records = {}, []
    for i in range(5):
        png = _png((i * 40, 10, 10))
        ref = image_ref(png)
        blobs[ref.sha256] = png
        records.append(
            PromptRecord(
                prompt_id=f"p{i}",
                data_source="synthetic" if i % 2 else "geo",
                problem="<image> what?",
                images=[ref],
                ground_truth=str(i),
            )
        )
    return records, blobs


@pytest.fixture
def transport(redis_server):
    t = broker.connect(redis_server.url)
    yield t
    t.close()


def _feeder(transport, names, data, **kw):
    records, blobs = data
    opts = dict(groups_per_step=2, max_staleness=1, epochs=2, seed=3)
    opts.update(kw)
    return PromptFeeder(transport, names, records, lambda ref: blobs[ref.sha256], **opts)


def _drain_deliveries(transport, names, n):
    sub = Subscriber(transport, names.prompts, "generators", "g0", expect=PromptRecord)
    got = []
    while len(got) < n:
        batch = sub.poll(count=n - len(got), block_s=0.5)
        assert batch, f"only {len(got)} of {n} prompts arrived"
        got += batch
        sub.ack([d for d, _ in batch])
    return got


def _drain(transport, names, n):
    return [m for _, m in _drain_deliveries(transport, names, n)]


def test_admission_min_version_rule():
    # B = 2, K = 1: positions 0,1 are trained at v, 2,3 at v + 1 -> both may start at v - 1 / v.
    assert [admission_min_version(5, q, 2, 1) for q in range(4)] == [4, 4, 5, 5]
    assert admission_min_version(5, 9, 2, 1) == 5  # capped at the current version: never waits ahead
    assert admission_min_version(0, 0, 2, 3) == 0
    assert [admission_min_version(3, q, 2, 0) for q in range(2)] == [3, 3]  # K = 0: synchronous


def test_top_up_keeps_b_times_k_plus_one_in_flight(transport, names, data):
    feeder = _feeder(transport, names, data)
    sub = Subscriber(transport, names.prompts, "generators", "g0", expect=PromptRecord)
    del sub
    assert feeder.top_up(taken=0, version=3) == 4
    assert feeder.top_up(taken=0, version=3) == 0  # still 4 in flight
    got = _drain_deliveries(transport, names, 4)
    assert [r.min_version for _, r in got] == [2, 2, 3, 3]
    assert all(r.split == "train" for _, r in got)
    store = ImageStore(transport, names)
    first = got[0][1].images[0]
    assert store.get(first) == data[1][first.sha256]
    ids = [group_id(r.prompt_id, d.id) for d, r in got]
    assert feeder.in_flight == set(ids)
    for gid in ids[:3]:
        assert feeder.returned(gid)
    assert not feeder.returned(ids[0]) and not feeder.returned("p1@0-1")  # twice, or never published
    assert feeder.top_up(taken=1, version=4) == 2  # one of the returned is in the step being collected
    assert feeder.state.published == 6 and feeder.state.epoch == 1


def test_epochs_cover_every_prompt_once_then_exhaust(transport, names, data):
    feeder = _feeder(transport, names, data, ahead=100)
    assert feeder.top_up(taken=0, version=0) == 10
    assert feeder.exhausted and feeder.top_up(taken=0, version=0) == 0
    got = _drain(transport, names, 10)
    first, second = [r.prompt_id for r in got[:5]], [r.prompt_id for r in got[5:]]
    assert sorted(first) == sorted(second) == [f"p{i}" for i in range(5)]
    assert first != second  # reshuffled per epoch (seeded)


def test_resume_prefers_the_newer_cursor(transport, names, data):
    feeder = _feeder(transport, names, data)
    feeder.top_up(taken=0, version=0)
    checkpointed = feeder.cursor()
    back = sorted(feeder.in_flight)[:2]
    for gid in back:
        feeder.returned(gid)
    feeder.top_up(taken=0, version=1)  # published after the checkpoint, then the learner died
    restarted = _feeder(transport, names, data)
    restarted.load_state(checkpointed)
    assert restarted.state == feeder.state
    assert restarted._next_record() is feeder._next_record()
    # the two that came back after the checkpoint were not durable: they are expected again
    assert restarted.in_flight == feeder.in_flight | set(back) and len(restarted.in_flight) == 6


def test_resume_expects_what_the_checkpoint_did_not_consume(transport, names, data):
    feeder = _feeder(transport, names, data)
    feeder.top_up(taken=0, version=0)
    first = sorted(feeder.in_flight)[0]
    feeder.returned(first)
    checkpointed, consumed = feeder.cursor(), {first}
    feeder.mark_durable({first})  # the checkpoint holds `first`
    feeder.top_up(taken=0, version=1)
    restarted = _feeder(transport, names, data)
    restarted.load_state(checkpointed, consumed=consumed)
    assert restarted.in_flight == feeder.in_flight and first not in restarted.in_flight
    assert restarted.tracking and not restarted.expects(first)


class _Killed(Exception):
    """kill -9 of the learner, at the point the test chooses."""


@pytest.mark.parametrize("dies", ["after the publish", "before the publish"])
def test_a_learner_killed_around_a_publish_publishes_nothing_twice(
    broker_url, names, data, monkeypatch, dies
):
    # The race of the roles-zmq fault case: the learner dies after a top-up's publish
    # returned and before its cursor reached the broker, with the last step's groups back but not
    # checkpointed (they are redelivered, so the restarted feeder's window is already full).
    # Dying just before the publish must not lose the batch either.
    first, second = broker.connect(broker_url), broker.connect(broker_url)
    try:
        audit = Subscriber(first, names.prompts, "audit", "a0", expect=PromptRecord)
        feeder = _feeder(first, names, data)  # 5 prompts x 2 epochs, 4 in flight
        feeder.load_state(None)
        feeder.top_up(taken=0, version=0)
        checkpointed = feeder.cursor()
        for gid in sorted(feeder.in_flight)[:2]:
            feeder.returned(gid)  # step 1 trained; no checkpoint yet

        publish = feeder.publisher.publish_many

        def killed(*args, **kwargs):
            if dies == "after the publish":
                publish(*args, **kwargs)
            raise _Killed

        monkeypatch.setattr(feeder.publisher, "publish_many", killed)
        with pytest.raises(_Killed):
            feeder.top_up(taken=0, version=1)

        restarted = _feeder(second, names, data)
        restarted.load_state(checkpointed)
        generator = Subscriber(second, names.prompts, "generators", "g0", expect=PromptRecord)
        unexpected, version = [], 1
        while not (restarted.exhausted and not restarted.in_flight):
            restarted.top_up(taken=0, version=version)
            got = generator.poll(count=10, block_s=0.5)
            assert got, f"stalled with {sorted(restarted.in_flight)} in flight"
            for delivery, record in got:
                gid = group_id(record.prompt_id, delivery.id)
                if not restarted.returned(gid):
                    unexpected.append(gid)  # the learner would dead-letter it: never trained
            generator.ack([d for d, _ in got])
            version += 1
        published = [r.prompt_id for _, r in audit.poll(count=100, block_s=0.5)]
        assert unexpected == []
        assert sorted(published) == sorted(r.prompt_id for r in data[0] for _ in range(2))
    finally:
        first.close()
        second.close()


def test_a_cursor_without_in_flight_ids_accepts_every_group(transport, names, data):
    restarted = _feeder(transport, names, data)
    restarted.load_state({"epoch": 0, "index": 3, "published": 3})
    assert not restarted.tracking and restarted.expects("anything@1-0")


def test_bad_image_bytes_are_refused(transport, names, data):
    records, blobs = data
    feeder = PromptFeeder(
        transport, names, records, lambda ref: _png((1, 2, 3)), groups_per_step=1, max_staleness=0
    )
    with pytest.raises(ValueError, match="hash to"):
        feeder.top_up(taken=0, version=0)
    with pytest.raises(ValueError, match="at least one"):
        PromptFeeder(transport, names, [], lambda ref: b"", groups_per_step=1, max_staleness=0)


def _scored(prompt_id, source, accs):
    samples = [
        Rollout.of(
            token_ids=[1],
            logprobs=[-0.1],
            response_text="x",
            version_start=0,
            version_end=0,
            finish_reason="stop",
        )
        for _ in accs
    ]
    group = RolloutGroup(
        group_id=f"g-{prompt_id}",
        prompt_id=prompt_id,
        data_source=source,
        prompt_token_ids=[1],
        images=[],
        ground_truth="1",
        samples=samples,
        split="test",
    )
    return ScoredGroup(group=group, scores=[Score(reward=a, accuracy=a, format=1.0) for a in accs])


def test_evaluation_round_reports_accuracy_per_source(transport, names, data):
    records, _ = data
    feeder = _feeder(transport, names, data)
    ev = Evaluator(feeder, records, EvalConfig(every=2, max_prompts=3, timeout_s=60))
    assert not ev.due(1) and ev.due(2)
    assert ev.start(step=2, version=2) == 3
    published = _drain(transport, names, 3)
    assert {r.split for r in published} == {"test"} and {r.min_version for r in published} == {2}
    assert [eval_round_of(r.prompt_id) for r in published] == [2, 2, 2]
    assert not ev.add(_scored(eval_prompt_id("p0", 1), "geo", [1.0]))  # an older round
    assert ev.add(_scored(eval_prompt_id("p0", 2), "geo", [1.0]))
    assert not ev.add(_scored(eval_prompt_id("p0", 2), "geo", [1.0]))  # duplicate
    assert ev.add(_scored(eval_prompt_id("p1", 2), "synthetic", [0.0, 1.0]))
    assert ev.poll() is None
    assert ev.add(_scored(eval_prompt_id("p2", 2), "geo", [0.0]))
    metrics = ev.poll()
    assert metrics["eval/accuracy/geo"] == 0.5 and metrics["eval/accuracy/synthetic"] == 0.5
    assert metrics["eval/missing"] == 0.0 and not ev.running


def test_evaluation_round_times_out_counting_missing(transport, names, data):
    records, _ = data
    ev = Evaluator(_feeder(transport, names, data), records, EvalConfig(every=1, timeout_s=0.0))
    ev.start(step=1, version=1)
    metrics = ev.poll()
    assert metrics["eval/missing"] == 5.0 and metrics["eval/accuracy"] == 0.0
