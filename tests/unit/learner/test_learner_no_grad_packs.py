"""The learner's no-grad passes (proximal recompute, KL reference): over joined micro-batches
(batching.no_grad_tokens_per_microbatch) they give the same step (metrics and weights) in fewer forwards,
every rank of a sharded learner plans the same number of packs, and the reference model is compiled like
the policy (tiny model, real Redis, fp32 CPU)."""

import dataclasses
import itertools

import pytest

from learner.advantages import batch_advantages
from learner.batching import sample_length
from learner.samples import to_samples
from learner.trainer import Learner
from learner.wiring import NullSender
from tests.fixtures.models import assert_same_update
from tests.unit.learner.test_trainer import _cfg


def _learner(tiny_model_dir, redis_server, names, run_dir, no_grad_tokens: int) -> Learner:
    kw = {"algo.groups_per_step": 4, "algo.mini_batches": 2, "algo.proximal": "recompute"}
    kw |= {"loss.kl_coef": 0.1, "batching.max_tokens_per_microbatch": 64}
    kw |= {"batching.no_grad_tokens_per_microbatch": no_grad_tokens}
    return Learner(_cfg(tiny_model_dir, redis_server, names, run_dir, **kw), sender=NullSender())


def _count_no_grad_forwards(learner: Learner) -> list[int]:
    calls = []
    forward = learner.updater.forward

    def counted(module, mb, with_entropy=True):
        if not with_entropy:
            calls.append(mb.num_tokens)
        return forward(module, mb, with_entropy)

    learner.updater.forward = counted
    return calls


def test_joined_no_grad_packs_train_the_same_step_in_fewer_forwards(
    tiny_model_dir, redis_server, names, publish, tmp_path
):
    for seed in range(4):  # one group without an image
        publish([1.0, 0.0, 0.5], seed=seed, image=seed != 2, resp_len=(4, 12))
    learners = [_learner(tiny_model_dir, redis_server, names, tmp_path / f"b{b}", b) for b in (0, 2000)]
    forwards = [_count_no_grad_forwards(learner) for learner in learners]
    before = [p.detach().clone() for p in learners[0].model.parameters()]
    groups = learners[0]._next_groups()
    assert groups and len(groups) == 4
    plain, joined = (learner.train_step(groups) for learner in learners)
    # proximal over mini-batch 2 + reference over both: one pack each when joined
    assert len(forwards[1]) == 3 < len(forwards[0])
    assert sum(forwards[1]) <= sum(forwards[0])  # joining never computes more (prompts shared across parts)
    assert joined["computed_tokens"] == plain["computed_tokens"]  # the training micro-batches are unchanged
    assert (
        joined["micro_batches"] == plain["micro_batches"] > joined["no_grad_packs"] == 2
    )  # one per mini-batch
    assert plain["no_grad_packs"] == plain["micro_batches"]  # the step's metrics say what ran
    for key in ("kl_ref", "ratio_mean", "clipped_frac", "grad_norm", "mismatch_kl", "entropy"):
        assert joined[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    assert_same_update(before, learners[0].model, learners[1].model)  # fp32 summation order only
    for learner in learners:
        learner.close()


def test_every_rank_plans_the_same_number_of_no_grad_packs(
    tiny_model_dir, redis_server, names, publish, tmp_path
):
    """Ranks with fewer packs run dummies: the count each rank runs must agree, or FSDP's collectives hang."""
    for seed in range(4):
        publish([1.0, 0.0, 0.5], seed=seed, resp_len=(4, 12))
    learner = _learner(tiny_model_dir, redis_server, names, tmp_path / "r", 0)
    groups = learner._next_groups()
    samples = to_samples(groups, batch_advantages([[s.reward for s in g.scores] for g in groups]))
    planner = learner.planner
    lengths = [sample_length(s, planner.image_tokens) for s in samples]
    uneven = 0
    for budget, world in itertools.product((64, 100, 120, 150, 1000), (2, 3)):
        learner.cfg.batching.no_grad_tokens_per_microbatch = budget
        plans = []
        for rank in range(world):
            planner.info = dataclasses.replace(learner.info, rank=rank, world_size=world)
            plans.append(planner.plan_mini_batch(samples, lengths))
        assert len({p.n_no_grad for p in plans}) == 1 and len({p.n_micro for p in plans}) == 1
        assert all(len(p.no_grad) <= p.n_no_grad and len(p.mine) <= p.n_micro for p in plans)
        uneven += len({len(p.no_grad) for p in plans}) > 1  # some rank runs a dummy pack
        trained = sorted(id(s) for p in plans for mb in p.mine for s in mb.samples)
        assert trained == sorted(id(s) for s in samples)  # every sample on exactly one rank
        for p in plans:  # a rank's packs hold exactly its own micro-batches, in order
            assert [mb for _, parts in p.no_grad for mb in parts] == p.mine
            for pack, parts in p.no_grad:
                assert pack.samples == [s for mb in parts for s in mb.samples]
    assert uneven  # the case that needs the dummies was planned
    learner.close()


def test_the_reference_model_is_compiled_like_the_policy(tiny_model_dir, redis_server, names, tmp_path):
    """The KL pass runs over every token of a step: it gets the policy's fused kernels (it ran eager)."""
    kw = {"loss.kl_coef": 0.1, "parallel.compile": "elementwise"}
    learner = Learner(_cfg(tiny_model_dir, redis_server, names, tmp_path, **kw), sender=NullSender())

    def compiled(root):
        return sum(getattr(m, "_compiled_call_impl", None) is not None for m in root.modules())

    assert compiled(learner.ref) == compiled(learner.model) > 0
    assert learner.ref.compile_logprobs and learner.model.compile_logprobs
    learner.close()
