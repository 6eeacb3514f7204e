"""batching.share_prompts on the Learner: the same step (weights and loss metrics) as unshared rows, on
fewer computed tokens (tiny model, real Redis, fp32 CPU)."""

import pytest

from learner.trainer import Learner
from learner.wiring import NullSender
from tests.fixtures.models import assert_same_update
from tests.unit.learner.test_trainer import _cfg


def test_shared_prompts_train_the_same_step_on_fewer_tokens(
    tiny_model_dir, redis_server, names, publish, tmp_path
):
    kw = {"algo.groups_per_step": 4, "algo.mini_batches": 2, "algo.proximal": "recompute"}
    kw |= {"loss.kl_coef": 0.1, "batching.max_tokens_per_microbatch": 400}
    for seed in range(4):  # one group without an image
        publish([1.0, 0.0, 0.5], seed=seed, image=seed != 2, resp_len=(4, 12))
    learners = [
        Learner(
            _cfg(
                tiny_model_dir,
                redis_server,
                names,
                tmp_path / name,
                **kw,
                **{"batching.share_prompts": share},
            ),
            sender=NullSender(),
        )
        for name, share in (("plain", False), ("shared", True))
    ]
    before = [p.detach().clone() for p in learners[0].model.parameters()]
    groups = learners[0]._next_groups()
    assert groups and len(groups) == 4
    plain, shared = (learner.train_step(groups) for learner in learners)
    assert shared["tokens"] == plain["tokens"] == plain["computed_tokens"]
    assert (
        shared["computed_tokens"] < plain["computed_tokens"] - 2 * 4 * 8
    )  # at least 2 prompts of 8 saved per group
    for key in ("kl_ref", "ratio_mean", "clipped_frac", "entropy", "grad_norm", "mismatch_kl"):
        assert shared[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    assert_same_update(before, learners[0].model, learners[1].model)
    for learner in learners:
        learner.close()
