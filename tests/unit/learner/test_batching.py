"""Token-budget micro-batching, rank assignment, staleness filter, group validation, packing."""

import pytest
import torch

import broker
from broker.images import ImageStore
from learner.advantages import batch_advantages
from learner.batching import (
    PackedMicroBatch,
    assign_to_ranks,
    join_microbatches,
    plan_microbatches,
    sample_length,
    shared_lengths,
)
from learner.samples import (
    TrainSample,
    filter_stale,
    filter_truncated,
    spans_versions,
    to_samples,
    validate_group,
)
from policy.packing import PixelCache
from tests.unit.learner.groups import make_group, set_token


def test_microbatches_respect_the_budget_and_keep_every_sample():
    lengths = [50, 10, 90, 40, 30, 200, 60]
    bins = plan_microbatches(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert sum(lengths[i] for i in b) <= 100 or len(b) == 1  # only an over-long sample exceeds it, alone
    assert [5] in bins
    assert len(bins) == 4  # 200 | 90+10 | 60+40 | 50+30: first-fit decreasing packs tightly
    with pytest.raises(ValueError):
        plan_microbatches([1], 0)


def test_microbatches_keep_a_group_together_when_it_fits():
    lengths = [30, 40, 30, 50, 20, 45, 60, 70]
    groups = ["a", "b", "a", "b", "a", "c", "d", "d"]  # a = 80, b = 90, c = 45, d = 130 (over the budget)
    bins = plan_microbatches(lengths, 100, groups)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 100 for b in bins)
    where = {i: k for k, b in enumerate(bins) for i in b}
    assert where[0] == where[2] == where[4] and where[1] == where[3]  # whole groups share a micro-batch
    assert where[6] != where[7]  # an over-budget group is split
    plain = {i: k for k, b in enumerate(plan_microbatches(lengths, 100)) for i in b}
    assert len({plain[0], plain[2], plain[4]}) > 1  # without groups, first-fit decreasing scatters group a


def test_shared_prompt_lengths_are_what_the_row_computes_and_never_exceed_the_budget():
    """Groups a (prompt 20, responses 10, 15, 5) and b (prompt 30, responses 40, 50): a fits a budget of 100
    whole (20 + 30 = 50 tokens with its prompt once), b (120) does not and keeps its unshared lengths."""

    def sample(group, prompt, response):
        return TrainSample(group, [1] * prompt, [2] * response, [-0.1] * response, 0.0, version_start=0)

    samples = [sample("a", 20, 10), sample("b", 30, 40), sample("a", 20, 15), sample("b", 30, 50)]
    samples.append(sample("a", 20, 5))
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    shared = shared_lengths(samples, lengths, 100)
    assert shared == [30, 70, 15, 80, 5]  # a: its first sample carries the prompt; b: unshared
    bins = plan_microbatches(shared, 100, [s.group_id for s in samples])
    assert [0, 2, 4] in bins and all(sum(shared[i] for i in b) <= 100 for b in bins)


def test_joined_microbatches_keep_order_and_the_budget():
    lengths = [30, 30, 40, 50, 20, 90, 10, 150]
    bins = [[0, 1], [2], [3, 4], [5], [6], [7]]  # 60 | 40 | 70 | 90 | 10 | 150 (an over-long sample) tokens
    assert join_microbatches(bins, lengths, 100) == [[0, 1], [2], [3, 4], [5]]
    assert join_microbatches(bins, lengths, 1000) == [[0, 1, 2, 3, 4, 5]]
    assert join_microbatches(bins, lengths, 60) == [[j] for j in range(6)]  # nothing fits together
    assert join_microbatches(bins, lengths, 0) == [[j] for j in range(6)]  # the config's "off"
    assert join_microbatches([], lengths, 100) == []


def test_rank_assignment_balances_tokens_and_is_deterministic():
    lengths = [100, 90, 80, 70, 60, 50]
    bins = [[i] for i in range(6)]
    per_rank = assign_to_ranks(bins, lengths, 2)
    loads = [sum(lengths[b[0]] for b in r) for r in per_rank]
    assert abs(loads[0] - loads[1]) <= 30 and sum(loads) == sum(lengths)
    assert per_rank == assign_to_ranks(bins, lengths, 2)
    assert assign_to_ranks(bins[:1], lengths, 3)[1:] == [[], []]  # idle ranks get nothing (they run dummies)


@pytest.fixture
def store(redis_server, names):
    t = broker.connect(redis_server.url)
    yield ImageStore(t, names)
    t.close()


def test_samples_carry_group_advantages_and_pack(tiny_processor, store):
    groups = [
        make_group(tiny_processor, store, [1.0, 0.0, 0.5], seed=1),
        make_group(tiny_processor, store, [0.0, 1.0], seed=2, image=False, version=3),
    ]
    advs = batch_advantages([[s.reward for s in g.scores] for g in groups], "drgrpo")
    samples = to_samples(groups, advs)
    assert [s.advantage for s in samples] == pytest.approx([0.5, -0.5, 0.0, -0.5, 0.5])
    kept, dropped = filter_stale(samples, version=4, max_staleness=2)
    assert dropped == 3 and all(s.version_start == 3 for s in kept)
    cache = PixelCache(tiny_processor.image_processor)
    image_token = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    mb = PackedMicroBatch.build(samples, store.get, cache, image_token)
    assert mb.has_images and mb.packed.num_tokens == sum(
        sample_length(s, lambda ref: 4) for s in samples
    )  # a 56x56 image is 4 tokens on the tiny processor
    n = sum(len(s.response_ids) for s in samples)
    assert mb.behaviour_logprobs.shape == (n,) and mb.advantages.shape == (n,)
    assert mb.seq_index.tolist() == [i for i, s in enumerate(samples) for _ in s.response_ids]
    assert torch.equal(mb.advantages[mb.seq_index == 1], torch.full(((mb.seq_index == 1).sum(),), -0.5))


def test_truncated_samples_are_masked_after_their_group_advantages(tiny_processor, store):
    import msgspec

    group = make_group(tiny_processor, store, [1.0, 0.0, 0.0], seed=4)
    cut = msgspec.structs.replace(group.group.samples[2], finish_reason="length")
    group = msgspec.structs.replace(
        group, group=msgspec.structs.replace(group.group, samples=[*group.group.samples[:2], cut])
    )
    advs = batch_advantages([[s.reward for s in group.scores]], "drgrpo")
    samples = to_samples([group], advs)
    assert [s.truncated for s in samples] == [False, False, True]
    kept, masked = filter_truncated(samples)
    assert masked == 1 and [s.truncated for s in kept] == [False, False]
    # the truncated sample still shaped the baseline: mean reward 1/3, not 1/2
    assert [s.advantage for s in kept] == pytest.approx([2 / 3, -1 / 3])


def test_samples_keep_both_versions_and_spans_are_counted(tiny_processor, store):
    import msgspec

    group = make_group(tiny_processor, store, [1.0, 0.0], seed=5, version=2)
    spanned = msgspec.structs.replace(group.group.samples[1], version_end=3)  # an in-flight update
    group = msgspec.structs.replace(
        group, group=msgspec.structs.replace(group.group, samples=[group.group.samples[0], spanned])
    )
    samples = to_samples([group], [[0.5, -0.5]])
    assert [(s.version_start, s.version_end) for s in samples] == [(2, 2), (2, 3)]
    assert [spans_versions(s) for s in samples] == [False, True]
    assert filter_stale(samples, version=3, max_staleness=1)[1] == 0  # staleness counts from version_start
    assert filter_stale(samples, version=4, max_staleness=1)[1] == 2


def test_validate_group_names_the_problem(tiny_processor, store):
    good = make_group(tiny_processor, store, [1.0, 0.0])
    assert validate_group(good) is None
    bad = make_group(tiny_processor, store, [1.0, 0.0])
    bad.group.samples[1].behaviour_logprobs_f32 = bad.group.samples[1].behaviour_logprobs_f32[
        :-4
    ]  # one fewer
    assert "logprobs" in validate_group(bad)
    short = make_group(tiny_processor, store, [1.0, 0.0])
    short.scores.pop()
    assert "scores" in validate_group(short)
    oov = make_group(tiny_processor, store, [1.0, 0.0])
    set_token(oov, sample=0, index=0, token=10**6)
    assert validate_group(oov) is None and "vocabulary" in validate_group(oov, vocab_size=1000)
    empty = make_group(tiny_processor, store, [])
    assert validate_group(empty) == "empty"


def test_two_image_samples_pack_each_image_once_per_group(tiny_processor, store):
    groups = [
        make_group(tiny_processor, store, [1.0, 0.0, 0.5], seed=6, n_images=2),
        make_group(tiny_processor, store, [0.0, 1.0], seed=7),
    ]
    samples = to_samples(groups, [[0.5, -0.5, 0.0], [-0.5, 0.5]])
    assert [len(s.images) for s in samples] == [2, 2, 2, 1, 1]
    cache = PixelCache(tiny_processor.image_processor)
    image_token = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    mb = PackedMicroBatch.build(samples, store.get, cache, image_token)
    packed = mb.packed
    assert packed.num_image_occurrences == 8 and packed.image_grid_thw.shape[0] == 3  # 2 + 1 distinct
    assert packed.image_index.tolist() == [0, 1, 0, 1, 0, 1, 2, 2]
    assert int((packed.input_ids == image_token).sum()) == 8 * 4  # 4 tokens per 56x56 image
    assert packed.num_tokens == sum(sample_length(s, lambda ref: 4) for s in samples)


def test_image_pads_that_disagree_with_the_images_are_named_with_both_counts(tiny_processor, store):
    image_token = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    good = make_group(tiny_processor, store, [1.0, 0.0], seed=8, n_images=2)
    assert validate_group(good, image_token_id=image_token) is None
    bad = make_group(tiny_processor, store, [1.0, 0.0], seed=8, n_images=2)
    bad.group.images = bad.group.images[:1]  # two placeholders, one image
    assert validate_group(bad) is None  # the check needs the pad id
    problem = validate_group(bad, image_token_id=image_token)
    assert problem == "prompt p8: 2 image pads in the prompt ids but 1 images"
    samples = to_samples([bad], [[0.5, -0.5]])
    cache = PixelCache(tiny_processor.image_processor)
    with pytest.raises(
        ValueError, match=f"group {bad.group.group_id}: 2 image pads in the prompt but 1 images"
    ):
        PackedMicroBatch.build(samples, store.get, cache, image_token)
    padded = make_group(tiny_processor, store, [1.0, 0.0], seed=8, n_images=2)
    set_token(padded, sample=1, index=0, token=image_token)  # the generator bans it; a bad peer may not
    assert validate_group(padded) is None
    assert validate_group(padded, image_token_id=image_token) == (
        "sample 1: its response holds image pad tokens (no image stands behind them)"
    )


def test_samples_of_lost_versions_count_as_stale():
    from learner.samples import TrainSample, filter_stale, staleness

    def at(version):
        return TrainSample("g", [1], [2], [-0.1], 0.0, version_start=version)

    samples = [at(v) for v in (1, 2, 3, 4, 5, 7)]
    # restored at version 2, versions 3-4 lost: 5 is the restored weights, 6 one update later
    kept, dropped = filter_stale(samples, version=6, max_staleness=1, lost=[[3, 4]])
    assert [s.version_start for s in kept] == [2, 5] and dropped == 4  # 1: too old, 3-4: lost, 7: unknown
    assert [staleness(6, s, [[3, 4]]) for s in kept] == [1, 1]  # 2 and 5 are the same weights


def test_nonfinite_rewards_and_logprobs_are_named():
    from broker.schemas import Rollout, RolloutGroup, Score, ScoredGroup
    from learner.samples import nonfinite_problem

    def scored(reward, logprob):
        sample = Rollout.of(
            token_ids=[1],
            logprobs=[logprob],
            response_text="",
            version_start=0,
            version_end=0,
            finish_reason="stop",
        )
        group = RolloutGroup(
            group_id="g",
            prompt_id="p",
            data_source="s",
            prompt_token_ids=[1],
            images=[],
            ground_truth="",
            samples=[sample],
        )
        return ScoredGroup(group=group, scores=[Score(reward=reward, accuracy=0.0, format=0.0)])

    assert nonfinite_problem(scored(1.0, -0.5)) is None
    assert "reward nan" in nonfinite_problem(scored(float("nan"), -0.5))
    assert "reward inf" in nonfinite_problem(scored(float("inf"), -0.5))
    assert "logprob -inf" in nonfinite_problem(scored(1.0, float("-inf")))


def test_the_batching_budgets_are_checked_by_name():
    from learner.config import LearnerConfig
    from runtime.config import load_config

    flags = ["--model", "/x", "--batching.max-tokens-per-microbatch", "4096"]
    cfg = load_config(LearnerConfig, [*flags, "--batching.no-grad-tokens-per-microbatch", "2048"])
    assert (
        cfg.batching.no_grad_tokens_per_microbatch == 2048
    )  # below the training budget: joins less, no error
    with pytest.raises(SystemExit, match="no_grad_tokens_per_microbatch >= 0"):
        load_config(LearnerConfig, [*flags, "--batching.no-grad-tokens-per-microbatch", "-1"])
