"""Batch preparation (generator.prepare) and the worker loop around it, with a fake engine over both brokers.

Missing, corrupt and undecodable images, an image bomb (a header declaring 13000 x 13000 pixels) and a
prompt whose pads do not match its images are rejected with their reasons, in place, while the rest of
the batch is prepared and published; the same with the preparation pool and serially in the loop thread.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor

import pytest

import broker
from broker.channel import Publisher, Subscriber
from broker.images import ImageStore
from broker.names import Names
from broker.schemas import ImageRef, PromptRecord, RolloutGroup
from generator.inputs import Completion, Result
from generator.prepare import prepare_batch
from tasks.prompt import render_prompt_ids
from tests.fixtures.models import noisy_png, png_declaring
from weights.config import WeightReceiverConfig


def noise_png(seed: int, size=(48, 40)) -> bytes:
    return noisy_png(seed, size)


@pytest.fixture
def transport(broker_url):
    t = broker.connect(broker_url)
    yield t
    t.close()


def corrupt_ref(store: ImageStore) -> ImageRef:
    real = noise_png(99)
    ref = ImageRef(sha256=hashlib.sha256(real).hexdigest())
    store.transport.put_blob(store.names.blob(ref.sha256), real[:-4] + b"XXXX", ttl_s=60)
    return ref


def undecodable_ref(store: ImageStore) -> ImageRef:
    data = b"\x89PNG\r\n\x1a\n and then garbage"
    ref = ImageRef(sha256=hashlib.sha256(data).hexdigest())
    store.transport.put_blob(store.names.blob(ref.sha256), data, ttl_s=60)
    return ref


def batch(store: ImageStore) -> tuple[list[PromptRecord], dict[str, str]]:
    """Records in stream order and the reason each bad one must be rejected with."""
    good = [store.put(noise_png(i)) for i in range(4)]
    missing = ImageRef(sha256="0" * 64)

    def rec(pid, images, problem="<image> What is it?"):
        return PromptRecord(prompt_id=pid, data_source="t", problem=problem, images=images, ground_truth="1")

    records = [
        rec("p0", [good[0]]),
        rec("missing", [missing]),
        rec("p1", [good[1], good[2]], "<image><image> Same?"),
        rec("corrupt", [corrupt_ref(store)]),
        rec("two-bad", [good[3], missing]),
        rec("mismatch", [good[0]], "<image><image> Two pads"),
        rec("p2", [good[0]]),
        rec("undecodable", [undecodable_ref(store)]),
        rec("text", [], "No image here"),
        rec("bomb", [store.put(png_declaring(13000, 13000))]),
        rec("p3", [good[3]]),
    ]
    reasons = {
        "missing": "image_missing",
        "corrupt": "image_undecodable",
        "two-bad": "image_missing",
        "mismatch": "image_count_mismatch",
        "undecodable": "image_undecodable",
        "bomb": "image_too_large",
    }
    return records, reasons


@pytest.mark.parametrize("threads", [0, 4])
def test_prepare_batch_keeps_order_and_rejects_only_the_bad_records(
    transport, names, tiny_processor, threads
):
    store = ImageStore(transport, names)
    records, reasons = batch(store)
    pool = ThreadPoolExecutor(threads) if threads else None
    try:
        prepared = prepare_batch(records, store, tiny_processor.tokenizer, pool)
    finally:
        if pool:
            pool.shutdown()
    assert len(prepared) == len(records)
    for record, p in zip(records, prepared):
        if record.prompt_id in reasons:
            assert p.request is None and p.reason == reasons[record.prompt_id] and p.detail
            continue
        assert p.reason == "" and p.request.split == record.split
        expected_ids = render_prompt_ids(tiny_processor, record.problem, len(record.images))
        assert p.request.prompt_token_ids == expected_ids
        assert [im.tobytes() for im in p.request.images] == [store.open(r).tobytes() for r in record.images]
    assert "not in the blob store" in prepared[1].detail and "hash to" in prepared[3].detail


class FakeEngine:
    """Returns two canned completions per request at once and records what it was given."""

    on_cpu = True
    version = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests = []

    def generate(self, requests):
        self.requests += requests
        completion = Completion(
            token_ids=[5, 6, 7], logprobs=[-0.5, -1.0, -0.25], text="abc", finish_reason="length"
        )
        return [
            Result(completions=[completion] * 2, version=0, prompt_len=10, seconds=0.01) for _ in requests
        ]

    def close(self):
        pass


@pytest.mark.parametrize("threads", [0, 4])
def test_worker_rejects_bad_images_with_their_reasons_and_publishes_the_rest(
    broker_url, names, tiny_processor, threads
):
    from broker.config import BrokerConfig
    from generator.config import GeneratorConfig
    from generator.worker import GeneratorWorker

    transport = broker.connect(broker_url)
    store = ImageStore(transport, names)
    records, reasons = batch(store)
    Publisher(transport, names.prompts).publish_many(records)
    engine = FakeEngine(tiny_processor.tokenizer)
    config = GeneratorConfig(
        broker=BrokerConfig(namespace=names.namespace),
        generator_id="gen-prep",
        weight_sync=WeightReceiverConfig(enabled=False),
        block_s=0.05,
        batch_prompts=len(records),
        prepare_threads=threads,
        idle_exit_s=0.3,
    )
    worker = GeneratorWorker(config, engine=engine, transport=transport)
    try:
        assert (worker.pool is not None) == (threads > 0)
        assert worker.run() == len(records) - len(reasons)
        sub = Subscriber(transport, names.rollouts, Names.REWARD, "test", expect=RolloutGroup)
        groups = {g.prompt_id: g for _, g in sub.poll(count=100, block_s=0.1)}
        assert sorted(groups) == sorted(r.prompt_id for r in records)
        good = [r for r in records if r.prompt_id not in reasons]
        assert [len(r.images) for r in engine.requests] == [len(r.images) for r in good]  # in stream order
        for rec, request in zip(good, engine.requests):
            g = groups[rec.prompt_id]
            assert (
                g.prompt_token_ids
                == request.prompt_token_ids
                == render_prompt_ids(tiny_processor, rec.problem, len(rec.images))
            )
            assert [im.tobytes() for im in request.images] == [store.open(r).tobytes() for r in rec.images]
            assert len(g.samples) == 2 and g.timings["images"] > 0 and g.timings["generate"] == 0.01
        for pid in reasons:
            assert groups[pid].samples == [] and groups[pid].timings == {"rejected": 1.0}
        dead = sorted(d.reason.split(":")[0] for d in transport.dead_letters(names.prompts))
        assert dead == sorted(reasons.values())
        assert transport.pending(names.prompts, Names.GENERATORS) == 0
        m = worker.metrics
        for reason in set(reasons.values()):
            assert m.value("parallax_generator_rejected_prompts_total", reason=reason) == list(
                reasons.values()
            ).count(reason)
    finally:
        worker.close()
    assert worker.pool is None or worker.pool._shutdown


def test_the_pool_has_at_most_one_thread_per_cpu():
    from generator.prepare import make_pool, usable_cpus

    assert make_pool(0) is None
    for threads in (1, 10_000):
        pool = make_pool(threads)
        try:
            assert pool._max_workers == min(threads, usable_cpus())
        finally:
            pool.shutdown()
