"""ContinuousLoop's admission (freed slots are refilled a whole admission, `batch_prompts`, at a time)
and the continuous-mode settings GeneratorConfig.validate refuses."""

from types import SimpleNamespace

import pytest

from generator.config import GeneratorConfig
from generator.streaming import ContinuousLoop


class Prompts:
    """The worker's prompt intake (`GeneratorWorker.admit_prompts`) over an empty stream."""

    def __init__(self):
        self.polls = []

    def admit_prompts(self, count, block_s):
        self.polls.append(count)
        return []  # nothing came: nothing to prepare


def loop_with(inflight: int, batch: int = 4, max_inflight: int = 8) -> tuple[ContinuousLoop, Prompts]:
    prompts = Prompts()
    config = SimpleNamespace(
        max_inflight_prompts=max_inflight, batch_prompts=batch, block_s=0.0, weight_update="drain"
    )
    worker = SimpleNamespace(config=config, admit_prompts=prompts.admit_prompts, holding=False, engine=None)
    loop = ContinuousLoop(worker)
    loop.stream = SimpleNamespace(inflight=inflight)
    return loop, prompts


@pytest.mark.parametrize("inflight, polled", [(0, [4]), (3, [4]), (4, [4]), (5, []), (7, [])])
def test_refills_only_when_a_whole_admission_fits(inflight, polled):
    loop, prompts = loop_with(inflight)
    loop._admit()
    assert prompts.polls == polled


def test_admission_larger_than_the_window_still_fills_it():
    loop, prompts = loop_with(inflight=0, batch=16, max_inflight=8)
    loop._admit()
    assert prompts.polls == [8]
    loop, prompts = loop_with(inflight=2, batch=16, max_inflight=8)
    loop._admit()
    assert prompts.polls == []


def test_inflight_updates_need_the_continuous_loop():
    GeneratorConfig(continuous=True, weight_update="inflight").validate()
    GeneratorConfig().validate()
    with pytest.raises(ValueError, match="needs continuous"):
        GeneratorConfig(weight_update="inflight").validate()
    from runtime.config import from_dict

    with pytest.raises(ValueError, match="weight_update = 'abort': expected one of 'drain', 'inflight'"):
        from_dict(GeneratorConfig, {"continuous": True, "weight_update": "abort"})
    with pytest.raises(ValueError, match=">= 1"):
        GeneratorConfig(continuous=True, batch_prompts=0).validate()


def test_drain_mode_pauses_admission_only_while_the_learner_is_ahead():
    loop, _ = loop_with(inflight=2)
    loop.worker.gate = SimpleNamespace(learner=lambda: 3)
    loop.worker.engine = SimpleNamespace(version=2)
    assert loop._draining()
    loop.worker.engine.version = 3
    assert not loop._draining()
    loop.worker.engine.version = 2
    loop.inflight_updates = True  # weight_update = inflight: apply between steps, never drain
    assert not loop._draining()
