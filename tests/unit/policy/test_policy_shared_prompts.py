"""Shared prompts (policy/packing.py `share_prompts`): a group's prompt once in the row, each response
attending to it. Per model family: the same logprobs, entropies and gradients as the unshared row and
the padded transformers forward (fp32 CPU), for fewer tokens."""

from __future__ import annotations

import copy

import pytest
import torch

from policy.forward import PackedPolicy, varlen_attention
from policy.packing import pack
from tests.fixtures.models import group_samples, make_samples, padded_logprobs


def _mixed(processor, image_token):
    """Group a (3 responses, 2 images), a sample with its own prompt, then group b (2 responses, 1 image),
    interleaved with group a's last response: a pack's samples need not arrive grouped."""
    grouped = group_samples(processor, image_token)
    (alone,) = make_samples(processor, (1,), seed=5)
    return [grouped[0], grouped[1], alone, grouped[3], grouped[2], grouped[4]]


def test_the_prompt_is_in_the_row_once_and_each_response_continues_it(family_processor, ids):
    _, image_token = ids
    samples = _mixed(family_processor, image_token)
    plain, shared = pack(samples, image_token), pack(samples, image_token, share_prompts=True)
    p_a, p_b = len(samples[0].prompt_ids), len(samples[3].prompt_ids)
    assert shared.num_tokens == plain.num_tokens - 2 * p_a - p_b  # group a: 3 -> 1 prompt, b: 2 -> 1
    assert shared.sequence_tokens == plain.sequence_tokens == plain.num_tokens
    assert shared.num_image_occurrences == 2 + 1 + 1  # group a's two images, the lone sample's, b's
    for batch in (plain, shared):  # targets in sample order, whatever the row's order
        targets = batch.input_ids[0, batch.target_index].tolist()
        assert targets == [t for s in samples for t in s.response_ids]
    torch.testing.assert_close(
        shared.position_ids[:, 0, shared.target_index], plain.position_ids[:, 0, plain.target_index]
    )
    firsts = torch.cumsum(torch.tensor([0, *shared.response_lens[:-1]]), 0)
    sources = shared.state_index[firsts]  # each first response token comes from its prompt's last token
    assert shared.input_ids[0, sources].tolist() == [s.prompt_ids[-1] for s in samples]
    assert shared.causal_area() < plain.causal_area()
    assert plain.kv_index is None and shared.kv_index.numel() == int(shared.cu_seqlens_k[-1])


def test_shared_prompts_give_the_same_logprobs_entropies_and_gradients(family_processor, sharp_model, ids):
    pad_token, image_token = ids
    samples = _mixed(family_processor, image_token)
    model = copy.deepcopy(sharp_model).train()
    policy = PackedPolicy(model, chunk_size=8)
    values, entropies, grads = [], [], []
    for batch in (pack(samples, image_token), pack(samples, image_token, share_prompts=True)):
        model.zero_grad(set_to_none=True)
        lp, ent = policy(batch)
        (lp.sum() + 0.1 * ent.sum()).backward()
        values.append(lp.detach())
        entropies.append(ent.detach())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
    assert (values[1] - values[0]).abs().max().item() <= 1e-5
    assert (entropies[1] - entropies[0]).abs().max().item() <= 1e-5
    assert grads[0].keys() == grads[1].keys() and any("visual" in n for n in grads[0])
    for name, g in grads[1].items():  # equal up to fp32 summation order
        assert (g - grads[0][name]).norm() <= 1e-5 * grads[0][name].norm() + 1e-7, name
    ref = padded_logprobs(sharp_model, samples, pad_token, image_token)  # the packed forward's own margin:
    assert (values[1] - ref).abs().max().item() <= 5e-5  # up to 2e-5 on Qwen3-VL, shared or not
    assert ref.std() > 0.1  # the sharpened model's logprobs vary: the comparison can fail


def test_a_start_aligned_mask_would_be_detected(family_processor, sharp_model, ids, monkeypatch):
    """SDPA's own is_causal aligns at the start when a piece has more keys than queries: a response would
    then see only the first tokens of its prompt. The shared row's logprobs must differ if that happened."""
    import policy.forward as forward

    _, image_token = ids
    samples = group_samples(family_processor, image_token)
    with torch.no_grad():
        right, _ = PackedPolicy(sharp_model)(pack(samples, image_token, share_prompts=True))
    monkeypatch.setattr(forward, "_sdpa_per_sequence", _start_aligned)
    with torch.no_grad():
        wrong, _ = PackedPolicy(sharp_model)(pack(samples, image_token, share_prompts=True))
    assert (wrong - right).abs().max().item() > 1e-3


@pytest.mark.parametrize("preset", ["tiny-fullvocab", "qwen3-vl-tiny-fullvocab"])
def test_the_gpu_alignment_test_would_catch_a_start_aligned_kernel(preset, monkeypatch):
    """tests/gpu/test_gpu_packed_forward.py::test_shared_prompts_match_unshared_bf16 allows bf16 noise
    (mean 0.01, max 0.1) on an unsharpened random model: on its samples, a start-aligned kernel is far
    outside that."""
    import policy.forward as forward
    from policy.builder import build_model
    from policy.presets import model_config
    from policy.synthetic import synthetic_samples

    config = model_config(preset)
    model = build_model(preset, "cpu", torch.float32, seed=0).eval()
    samples = synthetic_samples(
        config, n=8, seed=5, text_tokens=24, image_side=224, response=(20, 60), group_size=4
    )  # the GPU test's model and samples
    with torch.no_grad():
        plain, _ = PackedPolicy(model)(pack(samples, config.image_token_id))
        monkeypatch.setattr(forward, "_sdpa_per_sequence", _start_aligned)
        wrong, _ = PackedPolicy(model)(pack(samples, config.image_token_id, share_prompts=True))
    assert (wrong - plain).abs().mean() > 5 * 0.01 and (wrong - plain).abs().max() > 3 * 0.1


def _start_aligned(query, key, value, cu, cu_k, dropout, scaling, causal):
    """`policy.forward._sdpa_per_sequence` with SDPA's own is_causal, which aligns at the start."""
    import policy.forward as forward

    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, sk:ek], value[:, :, sk:ek], is_causal=causal, scale=scaling
        )
        for (s, e), (sk, ek) in zip(forward._pairs(cu), forward._pairs(cu_k))
    ]
    return torch.cat(outs, dim=2).transpose(1, 2)


def test_the_cpu_attention_with_gathered_keys_equals_a_masked_full_attention():
    """Two pieces sharing a 5-token prefix, through varlen_attention's kv_index, against one SDPA call over
    the unshared sequences with an explicit causal mask."""
    torch.manual_seed(0)
    heads, dim, prefix, r1, r2 = 4, 8, 5, 3, 4
    q, k, v = (torch.randn(1, heads, prefix + r1 + r2, dim) for _ in range(3))
    kv_index = torch.cat([torch.arange(prefix), torch.arange(prefix), torch.arange(prefix, prefix + r1)])
    kv_index = torch.cat([kv_index, torch.arange(prefix), torch.arange(prefix + r1, prefix + r1 + r2)])
    cu_q = torch.tensor([0, prefix, prefix + r1, prefix + r1 + r2], dtype=torch.int32)
    cu_k = torch.tensor([0, prefix, 2 * prefix + r1, 3 * prefix + r1 + r2], dtype=torch.int32)
    module = torch.nn.Module()
    out, _ = varlen_attention(
        module, q, k, v, None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=prefix,
        max_length_k=prefix + r2, kv_index=kv_index,
    )  # fmt: skip
    for rows in (
        torch.arange(prefix + r1),
        torch.cat([torch.arange(prefix), torch.arange(prefix + r1, prefix + r1 + r2)]),
    ):
        full = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, rows], k[:, :, rows], v[:, :, rows], is_causal=True
        ).transpose(1, 2)
        torch.testing.assert_close(out[:, rows], full, rtol=1e-5, atol=1e-6)


def test_a_response_holding_image_tokens_is_refused(family_processor, ids):
    _, image_token = ids
    samples = group_samples(family_processor, image_token)
    samples[1].response_ids = [*samples[1].response_ids, image_token]
    with pytest.raises(ValueError, match="image tokens"):
        pack(samples, image_token, share_prompts=True)


def test_the_kernel_path_gathers_the_same_keys(family_processor, sharp_model, ids, monkeypatch):
    """The GPU branch (keys gathered as (T_k, heads, D) rows for a varlen kernel), run on CPU with a
    stand-in kernel built on the SDPA loop: the same logprobs as the CPU branch."""
    import policy.forward as forward

    _, image_token = ids
    batch = pack(group_samples(family_processor, image_token), image_token, share_prompts=True)
    with torch.no_grad():
        cpu, _ = PackedPolicy(sharp_model)(batch)

    def kernel(q, k, v, cu, cu_k, max_len, max_k, scaling, causal):
        assert k.shape[0] == int(cu_k[-1]) and k.is_contiguous()
        rows = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        return forward._sdpa_per_sequence(*rows, cu, cu_k, 0.0, scaling, causal)[0]

    monkeypatch.setenv("PARALLAX_ATTN_BACKEND", "torch_varlen")
    monkeypatch.setattr(forward, "_torch_varlen", kernel)
    with torch.no_grad():
        gpu_branch, _ = PackedPolicy(sharp_model)(batch)
    torch.testing.assert_close(gpu_branch, cpu, rtol=0, atol=1e-5)
