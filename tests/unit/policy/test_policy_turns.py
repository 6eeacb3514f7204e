"""Multi-turn packing numerics, per model family (fp32 CPU): positions over the whole conversation equal
transformers' get_rope_index, the model tokens' packed logprobs equal the padded transformers forward to
1e-5 with 1-3 images across the turns, shared prompts change nothing, and the environment's tokens get no
logprob, so no loss and no gradient."""

from __future__ import annotations

import copy

import pytest
import torch

from policy.forward import PackedPolicy, packed_logprobs
from policy.packing import pack
from policy.turns import expand_response
from tests.fixtures.models import padded_logprobs
from tests.fixtures.turns import group_turn_samples, turn_samples


def _targets(samples) -> torch.Tensor:
    """The flattened response tokens' mask of targets (model tokens), sample after sample."""
    return torch.tensor(
        [
            m
            for s in samples
            for m in (s.target_mask if s.target_mask is not None else [True] * len(s.response_ids))
        ]
    )


@pytest.mark.parametrize("share", [False, True])
def test_positions_over_the_conversation_equal_get_rope_index(family_processor, family_model, ids, share):
    _, image_token = ids
    samples = group_turn_samples(family_processor) + turn_samples(family_processor, (0, 1, 1), seed=2)
    batch = pack(samples, image_token, share_prompts=share)
    plain = pack(samples, image_token)
    assert torch.equal(
        batch.position_ids[:, 0, batch.target_index], plain.position_ids[:, 0, plain.target_index]
    )
    bounds = plain.cu_seqlens.tolist()
    for i, s in enumerate(samples):
        assert 1 <= len(s.image_grid_thw) <= 3
        seq = torch.tensor([s.prompt_ids + s.response_ids])
        ours = plain.position_ids[:, 0, bounds[i] : bounds[i + 1]]
        mm = (seq == image_token).int()
        grid = torch.tensor(s.image_grid_thw)
        ref, _ = family_model.model.get_rope_index(seq, mm_token_type_ids=mm, image_grid_thw=grid)
        assert torch.equal(ours, ref[:, 0])


@pytest.mark.parametrize("share", [False, True])
def test_model_tokens_logprobs_equal_the_padded_forward(family_processor, sharp_model, ids, share):
    pad_token, image_token = ids
    samples = turn_samples(family_processor, (0, 1, 1, 0, 1), seed=4) + group_turn_samples(family_processor)
    batch = pack(samples, image_token, share_prompts=share)
    with torch.no_grad():
        ours, _ = packed_logprobs(sharp_model, batch, chunk_size=16)
    ref = padded_logprobs(sharp_model, samples, pad_token, image_token)[_targets(samples)]
    assert ours.shape == ref.shape and len(ours) == sum(s.targets for s in samples)
    assert torch.isfinite(ref).all()  # no image pad is a target
    assert (ours - ref).abs().max().item() <= 1e-5
    assert ref.std() > 0.1


def test_the_tool_images_are_needed_to_match(family_processor, sharp_model, ids):
    """Swapping the crops of two episodes changes the model tokens after them: the test would catch images
    of a tool turn that were dropped, misplaced or positioned wrongly."""
    pad_token, image_token = ids
    samples = group_turn_samples(family_processor)
    swapped = copy.deepcopy(samples)
    a, b = swapped[0], swapped[2]  # one crop of the same size each: swap their pixels
    n = a.image_grid_thw[1][0] * a.image_grid_thw[1][1] * a.image_grid_thw[1][2]
    pa, pb = a.pixel_values[-n:].clone(), b.pixel_values[-2 * n : -n].clone()
    a.pixel_values[-n:], b.pixel_values[-2 * n : -n] = pb, pa
    a.image_keys, b.image_keys = None, None
    with torch.no_grad():
        ours, _ = packed_logprobs(sharp_model, pack(swapped, image_token))
    ref = padded_logprobs(sharp_model, samples, pad_token, image_token)[_targets(samples)]
    assert (ours - ref).abs().max().item() > 1e-3


def test_environment_tokens_get_no_logprob_and_no_gradient(family_processor, family_model, ids):
    _, image_token = ids
    model = copy.deepcopy(family_model).train()
    policy = PackedPolicy(model, chunk_size=8)
    samples = turn_samples(family_processor, (1, 0), seed=6)
    batch = pack(samples, image_token)
    hidden = {}

    def keep(module, args, output):
        output.last_hidden_state.retain_grad()
        hidden["h"] = output.last_hidden_state

    handle = model.model.language_model.register_forward_hook(keep)
    try:
        logprobs, entropy = policy(batch)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
    finally:
        handle.remove()
    grad = hidden["h"].grad[0].abs().sum(-1)
    sources = batch.target_index - 1
    used = torch.zeros_like(grad, dtype=torch.bool)
    used[sources] = True
    assert (grad[used] > 0).all()  # each model token's predicting state gets a gradient
    assert (grad[~used] == 0).all()  # no other state does: an environment token is never a target
    env = ~torch.tensor([m for s in samples for m in s.target_mask])
    assert env.sum() > 0 and len(logprobs) == len(env) - int(env.sum())
    targets = batch.input_ids[0, batch.target_index].tolist()
    assert image_token not in targets


def test_expand_response_refuses_what_does_not_add_up(ids):
    _, pad = ids
    ids_, mask = expand_response([5, pad, 6], [1, 0, 1], [(1, 4, 4)], pad)
    assert ids_ == [5] + [pad] * 4 + [6] and mask == [True] + [False] * 4 + [True]
    with pytest.raises(ValueError, match="model token"):
        expand_response([5, pad], [1, 1], [(1, 4, 4)], pad)
    with pytest.raises(ValueError, match="response images"):
        expand_response([5, pad], [1, 0], [], pad)
    with pytest.raises(ValueError, match="loss mask"):
        expand_response([5, 6], [1], [], pad)
