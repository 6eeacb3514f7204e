"""Packing and M-RoPE positions: equal to transformers' get_rope_index per sequence; expansion; errors."""

from __future__ import annotations

import pytest
import torch

from policy.mrope import mrope_position_ids
from policy.packing import PackSample, PixelCache, expand_image_pads, pack
from tests.fixtures.models import make_samples, noisy_png


@pytest.fixture(scope="module")
def image_token_id(tiny_processor):
    return tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")


@pytest.mark.parametrize("counts", [(0,), (1,), (2,), (0, 1, 2, 2, 1, 0)])
def test_positions_equal_get_rope_index_for_every_sequence(family_processor, family_model, counts):
    image_token_id = family_model.config.image_token_id
    samples = make_samples(family_processor, counts, seed=len(counts))
    batch = pack(samples, image_token_id)
    bounds = batch.cu_seqlens.tolist()
    grids = iter(batch.image_grid_thw.tolist() if batch.image_grid_thw is not None else [])
    for i, s in enumerate(samples):
        seq = torch.tensor([s.prompt_ids + s.response_ids])
        ours = batch.position_ids[:, 0, bounds[i] : bounds[i + 1]]
        assert ours[:, 0].tolist() == [0, 0, 0]  # restarted per sequence
        mm = (seq == image_token_id).int()
        if not s.image_grid_thw:
            assert ours.tolist() == [list(range(seq.shape[1]))] * 3
            continue
        grid = torch.tensor([next(grids) for _ in s.image_grid_thw])
        ref, _ = family_model.model.get_rope_index(seq, mm_token_type_ids=mm, image_grid_thw=grid)
        assert torch.equal(ours, ref[:, 0])


def test_pack_layout(tiny_processor, image_token_id):
    samples = make_samples(tiny_processor, (2, 0, 1))
    batch = pack(samples, image_token_id)
    lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    assert batch.cu_seqlens.tolist() == [0, lens[0], lens[0] + lens[1], sum(lens)]
    assert batch.cu_seqlens.dtype == torch.int32 and batch.max_seqlen == max(lens)
    assert batch.input_ids.shape == (1, sum(lens)) and batch.position_ids.shape == (3, 1, sum(lens))
    assert batch.response_lens == [len(s.response_ids) for s in samples]
    targets = batch.input_ids[0, batch.target_index]
    assert targets.tolist() == [t for s in samples for t in s.response_ids]
    assert batch.pixel_values.shape[0] == int(batch.image_grid_thw.prod(-1).sum())
    assert int((batch.input_ids == image_token_id).sum()) == int(batch.image_grid_thw.prod(-1).sum()) // 4
    assert [t.tolist() for t in batch.split(torch.arange(len(batch.target_index)))][1] == list(
        range(batch.response_lens[0], batch.response_lens[0] + batch.response_lens[1])
    )


def test_expand_image_pads_and_errors(image_token_id):
    ids = [5, image_token_id, 6, image_token_id, 7]
    out = expand_image_pads(ids, [(1, 4, 4), (1, 2, 6)], image_token_id)
    assert out == [5] + [image_token_id] * 4 + [6] + [image_token_id] * 3 + [7]
    with pytest.raises(ValueError, match="image pads"):
        expand_image_pads(ids, [(1, 4, 4)], image_token_id)
    with pytest.raises(ValueError, match="contiguous"):
        mrope_position_ids([1, image_token_id, 2], [(1, 4, 4)], image_token_id)
    with pytest.raises(ValueError, match="not covered"):
        mrope_position_ids([1, image_token_id, image_token_id], [], image_token_id)


def test_pack_rejects_inconsistent_samples(image_token_id):
    with pytest.raises(ValueError, match="response"):
        pack([PackSample(prompt_ids=[1, 2], response_ids=[])], image_token_id)
    with pytest.raises(ValueError, match="pixel values"):
        pack(
            [PackSample(prompt_ids=[image_token_id] * 4, response_ids=[3], image_grid_thw=[(1, 4, 4)])],
            image_token_id,
        )
    with pytest.raises(ValueError, match="zero samples"):
        pack([], image_token_id)


def test_pixel_cache_computes_each_image_once(tiny_processor):
    cache = PixelCache(tiny_processor.image_processor)
    data = noisy_png(1, (100, 60))
    first = cache.get("x", data)
    second = cache.get("x")
    assert second[0] is first[0] and first[1] == (1, 4, 8)
    assert (cache.hits, cache.misses) == (1, 1)
    with pytest.raises(KeyError):
        cache.get("unknown")
