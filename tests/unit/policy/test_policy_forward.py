"""Packed forward numerics, per model family: equal to the padded transformers forward (fp32 CPU, <= 1e-5)."""

from __future__ import annotations

import copy

import pytest
import torch

from policy.forward import PackedPolicy, chunked_logprobs, packed_logprobs, varlen_attention
from policy.packing import pack
from tests.fixtures.models import group_samples, make_samples, padded_logprobs


@pytest.mark.parametrize("counts,temperature", [((0, 1, 2, 2, 1, 0), 1.0), ((1, 1), 0.7), ((0, 0), 1.3)])
def test_packed_logprobs_equal_padded_forward(family_processor, sharp_model, ids, counts, temperature):
    pad_token, image_token = ids
    samples = make_samples(family_processor, counts, seed=7)
    with torch.no_grad():
        ours, entropy = packed_logprobs(
            sharp_model, pack(samples, image_token), temperature=temperature, chunk_size=16
        )
    ref = padded_logprobs(sharp_model, samples, pad_token, image_token, temperature)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= 1e-5
    assert ref.std() > 0.1  # the sharpened model's logprobs vary: the comparison can fail
    assert torch.all(entropy > 0)


def test_wrong_positions_would_be_detected(family_processor, sharp_model, ids):
    pad_token, image_token = ids
    samples = make_samples(family_processor, (1, 2), seed=3)
    batch = pack(samples, image_token)
    batch.position_ids = torch.arange(batch.num_tokens).view(1, 1, -1).expand(3, 1, -1).contiguous()
    with torch.no_grad():
        wrong, _ = packed_logprobs(sharp_model, batch)
    ref = padded_logprobs(sharp_model, samples, pad_token, image_token)
    assert (wrong - ref).abs().max().item() > 1e-3


def test_chunking_does_not_change_results_and_entropy_is_exact():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    states, targets = torch.randn(37, 8), torch.randint(0, 50, (37,))
    a, ea = chunked_logprobs(head, states, targets, 0.8, chunk_size=5)
    b, eb = chunked_logprobs(head, states, targets, 0.8, chunk_size=1000)
    assert torch.allclose(a, b) and torch.allclose(ea, eb)
    dist = torch.distributions.Categorical(logits=head(states) / 0.8)
    assert torch.allclose(a, dist.log_prob(targets), atol=1e-6)
    assert torch.allclose(ea, dist.entropy(), atol=1e-5)
    with pytest.raises(ValueError):
        chunked_logprobs(head, states, targets, 0.0)


def test_banned_tokens_get_no_mass_like_a_sampler_that_bans_them():
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 50, bias=False)
    states, targets = torch.randn(21, 8), torch.randint(2, 50, (21,))
    banned = [0, 1]
    lp, ent = chunked_logprobs(head, states, targets, 0.9, chunk_size=4, banned_token_ids=banned)
    logits = head(states) / 0.9
    logits[:, banned] = float("-inf")
    dist = torch.distributions.Categorical(logits=logits)
    assert torch.allclose(lp, dist.log_prob(targets), atol=1e-6)
    probs = dist.probs
    ref_entropy = -(probs[:, 2:] * probs[:, 2:].log()).sum(-1)
    assert torch.isfinite(ent).all() and torch.allclose(ent, ref_entropy, atol=1e-5)
    unmasked, _ = chunked_logprobs(head, states, targets, 0.9)
    assert (lp - unmasked).min() > 0  # the mass of the banned tokens moved onto the others


def test_gradients_flow_through_checkpointed_chunks_and_vision(family_processor, family_model, ids):
    _, image_token = ids
    model = copy.deepcopy(family_model).train()
    policy = PackedPolicy(model, chunk_size=8)
    batch = pack(make_samples(family_processor, (1, 0, 2), seed=1), image_token)
    logprobs, entropy = policy(batch)
    (logprobs.sum() + 0.01 * entropy.sum()).backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    assert model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0
    assert model.model.language_model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    for merger in getattr(model.model.visual, "deepstack_merger_list", []):  # Qwen3-VL's DeepStack
        assert merger.linear_fc2.weight.grad.abs().sum() > 0


def test_text_only_pack_can_still_run_the_vision_tower(family_processor, family_model, ids):
    _, image_token = ids
    model = copy.deepcopy(family_model).train()
    batch = pack(make_samples(family_processor, (0, 0), seed=2), image_token)
    plain, _ = PackedPolicy(model)(batch)
    logprobs, _ = PackedPolicy(model)(batch, run_vision_always=True)
    assert torch.allclose(plain, logprobs)
    logprobs.sum().backward()
    assert model.model.visual.patch_embed.proj.weight.grad is not None  # took part, with zero gradient
    for merger in getattr(model.model.visual, "deepstack_merger_list", []):
        assert merger.linear_fc2.weight.grad is not None


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_attention_cpu_path_equals_block_diagonal_sdpa(causal):
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    q, k, v = torch.randn(1, 4, 11, 8), torch.randn(1, 2, 11, 8), torch.randn(1, 2, 11, 8)
    cu = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    out, _ = varlen_attention(
        module,
        q,
        k,
        v,
        None,
        scaling=0.3,
        is_causal=causal,
        cu_seq_lens_q=cu,
        cu_seq_lens_k=cu,
        max_length_q=6,
        max_length_k=6,
    )
    seg = torch.repeat_interleave(torch.arange(3), torch.tensor([4, 1, 6]))
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask &= torch.ones(11, 11, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    assert out.shape == (1, 11, 4, 8)
    assert torch.allclose(out, ref, atol=1e-6)


def test_shared_images_are_encoded_once_with_the_same_values_and_gradients(
    family_processor, sharp_model, ids
):
    _, image_token = ids
    samples = group_samples(family_processor, image_token)
    dedup, plain = pack(samples, image_token), pack(samples, image_token, dedup_images=False)
    assert plain.image_index is None and plain.image_grid_thw.shape[0] == 8
    assert dedup.image_grid_thw.shape[0] == 3 and dedup.image_index.tolist() == [0, 1, 0, 1, 0, 1, 2, 2]
    assert dedup.pixel_values.shape[0] * 8 < plain.pixel_values.shape[0] * 3 + 1
    assert dedup.num_image_occurrences == plain.num_image_occurrences == 8
    model = copy.deepcopy(sharp_model).train()
    policy = PackedPolicy(model, chunk_size=8)
    grads, values = [], []
    for batch in (dedup, plain):
        model.zero_grad(set_to_none=True)
        lp, ent = policy(batch)
        (lp.sum() + 0.1 * ent.sum()).backward()
        values.append(lp.detach())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    assert (values[0] - values[1]).abs().max().item() <= 1e-6
    assert grads[0].keys() == grads[1].keys() and any("visual" in n for n in grads[0])
    for name, g in grads[0].items():  # equal up to fp32 summation order
        assert (g - grads[1][name]).norm() <= 1e-5 * grads[1][name].norm() + 1e-8, name
    ref = padded_logprobs(sharp_model, samples, ids[0], image_token)
    assert (values[0] - ref).abs().max().item() <= 1e-5


def test_one_key_with_two_grids_is_an_error(family_processor, ids):
    _, image_token = ids
    a, b = make_samples(family_processor, (1, 1), seed=2)
    b.image_keys = list(a.image_keys)
    with pytest.raises(ValueError, match="grids"):
        pack([a, b], image_token)


def test_qwen3_deepstack_features_are_needed_to_match(family_processor, sharp_model, ids):
    """Without DeepStack the packed forward differs from transformers (so the test above checks it)."""
    if not getattr(sharp_model.config.vision_config, "deepstack_visual_indexes", None):
        pytest.skip("Qwen2.5-VL has no DeepStack")
    pad_token, image_token = ids
    samples = make_samples(family_processor, (1, 2), seed=5)
    ref = padded_logprobs(sharp_model, samples, pad_token, image_token)
    model = copy.deepcopy(sharp_model)
    model.model.visual.deepstack_visual_indexes = []
    with torch.no_grad():
        without, _ = packed_logprobs(model, pack(samples, image_token))
    assert (without - ref).abs().max().item() > 1e-3


def test_split_per_image_takes_both_transformers_layouts_of_deepstack_features():
    """transformers 5.17 (the GPU image) returns Qwen3-VL's DeepStack features as one tensor of every image's
    tokens, 5.19 as per-image blocks: both become the same per-image blocks (the 5.17 layout once reached the
    decoder flattened: "size of tensor a (2560) must match ... (51200)")."""
    import torch

    from policy.forward import split_per_image

    whole = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    split = split_per_image(whole, [4, 3])
    assert [tuple(t.shape) for t in split] == [(4, 3), (3, 3)]
    assert torch.equal(torch.cat(split), whole)
    already = split_per_image(torch.split(whole, [4, 3]), [4, 3])
    assert all(torch.equal(a, b) for a, b in zip(already, split))


def test_varlen_kernel_keywords_are_read_once_and_name_what_the_call_passes():
    from policy.forward import _varlen_params

    params = _varlen_params()
    assert "scale" in params and ({"window_size", "is_causal"} & params)
    assert _varlen_params() is params  # cached: not inspected once per layer and pack
