"""A generator whose engine returns non-finite logprobs stops, not publishing groups the learner rejects.

An H100's vLLM under MPS capped at 40 % of the SMs returned NaN for every behaviour logprob (docs/
benchmarks.md, 2026-12-05): the learner skipped all 640 groups. The worker (generator/worker.py) now raises
EngineOutputError after NONFINITE_RUN such groups in a row, publishes none of them and leaves their prompts
unacked; a group with some finite samples, or a non-finite group between finite ones, still flows.
"""

from __future__ import annotations

import math

import pytest

import broker
from broker.channel import Publisher, Subscriber
from broker.images import ImageStore
from broker.names import Names
from broker.schemas import PromptRecord, RolloutGroup
from generator.inputs import Completion, Result
from tests.fixtures.models import noisy_png
from weights.config import WeightReceiverConfig


class NanEngine:
    """Two completions per request; a request's completions are NaN where `nan(i)` says so (i: request
    index over the run)."""

    on_cpu = True
    version = 0

    def __init__(self, tokenizer, nan):
        self.tokenizer, self.nan, self.seen = tokenizer, nan, 0

    def generate(self, requests):
        results = []
        for _ in requests:
            flags = self.nan(self.seen)
            self.seen += 1
            completions = [
                Completion(
                    token_ids=[5, 6],
                    logprobs=[-0.5, math.nan if bad else -1.0],
                    text="ab",
                    finish_reason="stop",
                )
                for bad in flags
            ]
            results.append(Result(completions=completions, version=0, prompt_len=10, seconds=0.01))
        return results

    def close(self):
        pass


def run_worker(broker_url, names, tokenizer, n_prompts: int, nan):
    from broker.config import BrokerConfig
    from generator.config import GeneratorConfig
    from generator.worker import GeneratorWorker

    transport = broker.connect(broker_url)
    store = ImageStore(transport, names)
    image = store.put(noisy_png(1, (48, 40)))
    records = [
        PromptRecord(
            prompt_id=f"p{i}", data_source="t", problem="<image> Which?", images=[image], ground_truth="1"
        )
        for i in range(n_prompts)
    ]
    Publisher(transport, names.prompts).publish_many(records)
    config = GeneratorConfig(
        broker=BrokerConfig(namespace=names.namespace),
        generator_id="gen-nan",
        weight_sync=WeightReceiverConfig(enabled=False),
        block_s=0.05,
        batch_prompts=n_prompts,
        prepare_threads=0,
        idle_exit_s=0.3,
    )
    worker = GeneratorWorker(config, engine=NanEngine(tokenizer, nan), transport=transport)
    return worker, transport


def published(transport, names) -> list[RolloutGroup]:
    sub = Subscriber(transport, names.rollouts, Names.REWARD, "test", expect=RolloutGroup)
    return [g for _, g in sub.poll(count=1000, block_s=0.1)]


def test_a_run_of_all_nan_groups_stops_the_generator_and_publishes_none(broker_url, names, tiny_processor):
    from generator.worker import NONFINITE_RUN, EngineOutputError

    worker, transport = run_worker(
        broker_url, names, tiny_processor.tokenizer, NONFINITE_RUN, lambda i: (1, 1)
    )
    try:
        with pytest.raises(EngineOutputError, match=f"every sample of {NONFINITE_RUN} groups in a row"):
            worker.run()
        assert published(transport, names) == []
        assert transport.pending(names.prompts, Names.GENERATORS) == NONFINITE_RUN  # redelivered to the next
    finally:
        worker.close()


def test_nan_groups_short_of_a_run_or_mixed_with_finite_ones_still_flow(broker_url, names, tiny_processor):
    from generator.worker import NONFINITE_RUN

    n = 3 * NONFINITE_RUN
    # every sample NaN except every NONFINITE_RUN - 1'th prompt (never NONFINITE_RUN in a row), whose first
    # sample is finite: partly broken groups reset the run as well
    worker, transport = run_worker(
        broker_url, names, tiny_processor.tokenizer, n, lambda i: (i % (NONFINITE_RUN - 1) != 0, 1)
    )
    try:
        assert worker.run() == n
        groups = published(transport, names)
        assert len(groups) == n and worker.nonfinite_groups == n and worker.nonfinite_run > 0
        assert all(math.isnan(g.samples[1].logprobs()[1]) for g in groups)  # passed on as they came
    finally:
        worker.close()


def test_the_error_names_an_mps_cap_as_the_likely_cause():
    from generator.worker import _nonfinite_hint

    assert _nonfinite_hint({}) == ""
    hint = _nonfinite_hint({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40"})
    assert "40 %" in hint and "--mps-generator-sms" in hint
