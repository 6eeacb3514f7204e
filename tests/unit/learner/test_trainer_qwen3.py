"""The Learner on the tiny Qwen3-VL (the family read from its config.json, nothing to choose): it trains
on groups of one and two images per prompt (vision tower, DeepStack mergers and decoder all move) and
its real weight sender gets every version to a receiver bit for bit, under Qwen3-VL's names and layouts."""

import time

import pytest
import torch

import broker
from broker.channel import Publisher
from broker.config import BrokerConfig
from broker.images import ImageStore
from learner.config import LearnerConfig
from learner.trainer import Learner
from tests.unit.learner.groups import make_group


@pytest.fixture(scope="module")
def qwen3_dir():
    from policy.builder import build_checkpoint

    return build_checkpoint("qwen3-vl-tiny", seed=0)


def test_qwen3_learner_trains_and_syncs_bit_for_bit(qwen3_dir, redis_server, names, tmp_path):
    import weights
    from policy.loading import load_model, load_processor
    from weights.follow import broker_resolver
    from weights.manifest import module_loader

    cfg = LearnerConfig(
        model=str(qwen3_dir),
        broker=BrokerConfig(url=redis_server.url, namespace=names.namespace),
        run_dir=str(tmp_path),
        max_steps=2,
        weight_sync=weights.WeightSyncConfig(timeout_s=20.0),
        idle_exit_s=3.0,
    )
    cfg.algo.groups_per_step = 2
    cfg.optim.lr = 1e-3
    cfg.checkpoint.every = 1
    cfg.batching.max_tokens_per_microbatch = 160
    transport = broker.connect(redis_server.url)
    publisher, store = Publisher(transport, names.scored), ImageStore(transport, names)
    processor = load_processor(qwen3_dir)
    for seed in range(4):  # one and two images per prompt
        publisher.publish(make_group(processor, store, [1.0, 0.0, 0.5], seed=seed, n_images=1 + seed % 2))
    learner = Learner(cfg)
    assert type(learner.hf).__name__ == "Qwen3VLForConditionalGeneration"
    before = {k: v.detach().clone() for k, v in learner.hf.state_dict().items()}
    replica = load_model(qwen3_dir)
    receiver = weights.receiver(
        weights.WeightSyncConfig(timeout_s=20.0),
        "gen-test",
        apply=module_loader(replica),
        resolve=broker_resolver(transport, names),
    ).start()
    try:
        deadline = time.monotonic() + 20
        while not learner.sender.members() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert learner.sender.members(), "the receiver did not join"
        learner.train()
        assert learner.state.step == 2
        assert receiver.wait_for(2, timeout_s=20)
        mine, theirs = learner.hf.state_dict(), replica.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        moved = {k for k in before if not torch.equal(before[k], mine[k])}
        for part in (
            "visual.blocks.0.",
            "visual.deepstack_merger_list.0.",
            "language_model.layers.0.",
            "lm_head",
        ):
            assert any(part in k for k in moved), part
    finally:
        receiver.close()
        transport.close()
        learner.close()
