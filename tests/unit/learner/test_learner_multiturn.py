"""Multi-turn episodes on the learner: the loss sees the model's tokens only, the tool turns' images are
packed with the prompt's, bad episodes are named, failed environments get no loss (tiny model, Redis)."""

from __future__ import annotations

import random
import uuid

import pytest

import broker
from broker.channel import Publisher
from broker.images import ImageStore
from broker.schemas import Rollout, RolloutGroup, Score, ScoredGroup
from learner.advantages import batch_advantages
from learner.batching import PackedMicroBatch, sample_length
from learner.samples import episode_stats, filter_env_failed, to_samples, validate_group
from learner.trainer import Learner
from learner.wiring import NullSender
from policy.packing import PixelCache
from tasks.prompt import render_prompt_ids
from tests.fixtures.models import assert_same_update
from tests.fixtures.turns import tool_turn_ids
from tests.unit.learner.groups import png
from tests.unit.learner.test_trainer import _cfg

ENV_LOGPROB = 0.0
"""What the generator writes as an environment token's logprob (it means nothing)."""


def episode_group(processor, store, rewards, seed=0, env_logprob=ENV_LOGPROB, version=0) -> ScoredGroup:
    """A scored group of episodes: a one-image prompt, each sample 1-2 model turns with a crop between."""
    rng = random.Random(seed)
    tok = processor.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompt_ref = store.put(png((rng.randrange(256), 90, 40), (112, 84)))
    samples = []
    for i, _ in enumerate(rewards):
        ids, mask, images = [], [], []
        for turn in range(1 + i % 2):
            model = [rng.randrange(30, min(len(tok), 1500) - 30) for _ in range(rng.randint(2, 6))] + [end]
            ids += model
            mask += [1] * len(model)
            if turn == 0 and i % 2:
                images.append(store.put(png((40, rng.randrange(256), 200), (56, 56))))
                env = tool_turn_ids(tok, 1)
                ids += env
                mask += [0] * len(env)
        logprobs = [-rng.uniform(1.0, 6.0) if m else env_logprob for m in mask]
        samples.append(
            Rollout.of(
                token_ids=ids,
                logprobs=logprobs,
                loss_mask=mask,
                response_text="",
                version_start=version,
                version_end=version,
                finish_reason="stop",
                images=images,
                turn_versions=[version] * (1 + i % 2),
                tool_calls=i % 2,
            )  # fmt: skip
        )
    group = RolloutGroup(
        group_id=uuid.uuid4().hex,
        prompt_id=f"p{seed}",
        data_source="synthetic",
        prompt_token_ids=render_prompt_ids(processor, "<image>Zoom in: which digit?", 1),
        images=[prompt_ref],
        ground_truth="3",
        samples=samples,
    )
    return ScoredGroup(group=group, scores=[Score(reward=r, accuracy=r, format=1.0) for r in rewards])


@pytest.fixture
def store(redis_server, names):
    t = broker.connect(redis_server.url)
    yield ImageStore(t, names)
    t.close()


def test_the_loss_tokens_are_the_model_tokens_and_the_crops_are_packed(tiny_processor, store):
    groups = [episode_group(tiny_processor, store, [1.0, 0.0, 0.5, 0.0], seed=1)]
    samples = to_samples(groups, batch_advantages([[1.0, 0.0, 0.5, 0.0]], "grpo"))
    for s, rollout in zip(samples, groups[0].group.samples):
        mask = rollout.loss_mask().astype(bool)
        assert s.behaviour_logprobs == pytest.approx(rollout.logprobs()[mask].tolist())
        assert s.loss_tokens == int(mask.sum()) < len(s.response_ids) or not rollout.images
    image_token = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    cache = PixelCache(tiny_processor.image_processor)
    for share in (False, True):
        mb = PackedMicroBatch.build(samples, store.get, cache, image_token, share)
        targets = mb.packed.input_ids[0, mb.packed.target_index].tolist()
        expected = [t for r in groups[0].group.samples for t, m in zip(r.token_ids(), r.loss_mask()) if m]
        assert targets == expected and image_token not in targets
        assert mb.behaviour_logprobs.shape == mb.advantages.shape == (len(expected),)
        assert mb.packed.num_image_occurrences == (1 if share else 4) + 2  # the prompt's, then 2 crops
    plain = PackedMicroBatch.build(samples, store.get, cache, image_token)
    assert plain.packed.num_tokens == sum(
        sample_length(s, lambda ref: ref.width * ref.height // 784) for s in samples
    )


def test_environment_logprobs_change_nothing_and_shared_prompts_train_the_same_step(
    tiny_model_dir, tiny_processor, redis_server, names, tmp_path
):
    transport = broker.connect(redis_server.url)
    store = ImageStore(transport, names)
    pub = Publisher(transport, names.scored)
    for seed in range(2):
        pub.publish(episode_group(tiny_processor, store, [1.0, 0.0, 0.5, 0.0], seed=seed))
    kw = {"algo.groups_per_step": 2, "batching.max_tokens_per_microbatch": 600}
    runs = {
        name: Learner(
            _cfg(tiny_model_dir, redis_server, names, tmp_path / name, **kw, **extra), sender=NullSender()
        )
        for name, extra in (("plain", {"batching.share_prompts": False}), ("shared", {}), ("other", {}))
    }
    before = [p.detach().clone() for p in runs["plain"].model.parameters()]
    groups = runs["plain"]._next_groups()
    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert len(groups) == 2 and all(validate_group(g, image_token_id=pad) is None for g in groups)
    other = [
        episode_group(tiny_processor, store, [1.0, 0.0, 0.5, 0.0], seed=s, env_logprob=-50.0)
        for s in range(2)
    ]
    for mine, theirs in zip(groups, other):  # the same episodes, environment logprobs replaced
        theirs.group.group_id = mine.group.group_id
    values = {
        "plain": runs["plain"].train_step(groups),
        "shared": runs["shared"].train_step(groups),
        "other": runs["other"].train_step(other),
    }
    assert values["plain"]["tool_calls_per_sample"] == 0.5 and values["plain"]["episode_turns"] == 1.5
    for name in ("shared", "other"):
        for key in ("ratio_mean", "mismatch_kl", "grad_norm", "entropy"):
            assert values[name][key] == pytest.approx(values["plain"][key], rel=1e-4, abs=1e-6), (name, key)
        assert_same_update(before, runs["plain"].model, runs[name].model)
    assert values["shared"]["computed_tokens"] < values["plain"]["computed_tokens"]
    for learner in runs.values():
        learner.close()
    transport.close()


def test_bad_episodes_are_named_and_failed_environments_get_no_loss(tiny_processor, store):
    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    good = episode_group(tiny_processor, store, [1.0, 0.0])
    assert validate_group(good, image_token_id=pad) is None

    def broken(change) -> str:
        scored = episode_group(tiny_processor, store, [1.0, 0.0])
        change(scored.group.samples[1])
        return validate_group(scored, image_token_id=pad)

    assert "no image stands behind them" in broken(lambda s: setattr(s, "images", []))
    assert "image pads" in broken(lambda s: s.images.append(s.images[0]))
    mask = bytes(
        1 if t == pad else m
        for t, m in zip(good.group.samples[1].token_ids(), good.group.samples[1].loss_mask())
    )
    assert "marked as a model token" in broken(lambda s: setattr(s, "loss_mask_u8", mask))
    zeros = bytes(len(good.group.samples[1].loss_mask_u8))
    assert "no model token" in broken(lambda s: setattr(s, "loss_mask_u8", zeros))
    good.group.samples[0].env_error = "timeout: the environment took more than 5 s"
    samples = to_samples([good], [[0.5, -0.5]])
    kept, dropped = filter_env_failed(samples)
    assert dropped == 1 and kept == samples[1:]
    stats = episode_stats([good])
    assert stats["env_failed"] == 1.0 and stats["tool_images_per_sample"] == 0.5
