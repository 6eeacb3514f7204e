"""Multi-turn samples for packing: the model's turns are trained, the environment's turns are context.

A multi-turn episode (generator/episodes.py) is one prompt followed by one response that interleaves
the model's turns with the environment's (tool responses, which may hold images). It travels with ONE
image pad per image, in the prompt and in the response alike, and a loss mask over the response
tokens: 1 for a token the model sampled, 0 for a token the environment appended.

`make_turn_sample` turns that into a `policy.packing.PackSample`: the pads of the prompt's images and
of the response's images are expanded to each image's token count, every expanded image token of the
response is an environment token, and the mask becomes the sample's `target_mask`, so the packed
forward computes logprobs (and so loss and gradient) of the model's tokens only. M-RoPE positions run
over the whole conversation, images of the tool turns included (`policy.mrope`), exactly as
transformers' `get_rope_index` gives them for the same sequence.

    sample = make_turn_sample(prompt_ids, response_ids, loss_mask, [(sha, png_bytes), ...], cache, pad_id)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from policy.mrope import image_token_count
from policy.packing import PackSample, PixelCache, expand_image_pads


def expand_response(
    response_ids: Sequence[int],
    loss_mask: Sequence[int] | None,
    image_grid_thw: Sequence[Sequence[int]],
    image_token_id: int,
    merge: int = 2,
) -> tuple[list[int], list[bool]]:
    """(expanded response ids, target mask): the i-th image pad of the response becomes image i's token
    count of pads, each an environment token (mask False); `loss_mask` None means every token is the
    model's. Raises ValueError when the pads and images disagree or the model's mask covers a pad."""
    if loss_mask is None:
        loss_mask = [1] * len(response_ids)
    if len(loss_mask) != len(response_ids):
        raise ValueError(f"a loss mask of {len(loss_mask)} for {len(response_ids)} response tokens")
    pads = sum(1 for t in response_ids if t == image_token_id)
    if pads != len(image_grid_thw):
        raise ValueError(f"{pads} image pads in the response but {len(image_grid_thw)} response images")
    ids: list[int] = []
    mask: list[bool] = []
    grids = iter(image_grid_thw)
    for token, model in zip(response_ids, loss_mask):
        if token != image_token_id:
            ids.append(int(token))
            mask.append(bool(model))
            continue
        if model:
            raise ValueError("an image pad of the response is marked as a model token")
        n = image_token_count(next(grids), merge)
        ids.extend([image_token_id] * n)
        mask.extend([False] * n)
    return ids, mask


def make_turn_sample(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    loss_mask: Sequence[int] | None,
    images: Sequence[tuple[str, bytes | None]],
    cache: PixelCache,
    image_token_id: int,
) -> PackSample:
    """A PackSample of a multi-turn episode from one-pad-per-image ids, the response's loss mask and
    (sha256, bytes) per image: the prompt's images first, then the response's, in order of their pads."""
    items = [cache.get(sha, data) for sha, data in images]
    grids = [grid for _, grid in items]
    merge = cache.image_processor.merge_size
    n_prompt = sum(1 for t in prompt_ids if t == image_token_id)
    if n_prompt > len(grids):
        raise ValueError(f"{n_prompt} image pads in the prompt but {len(grids)} images in all")
    response, mask = expand_response(response_ids, loss_mask, grids[n_prompt:], image_token_id, merge)
    return PackSample(
        prompt_ids=expand_image_pads(prompt_ids, grids[:n_prompt], image_token_id, merge),
        response_ids=response,
        image_grid_thw=grids,
        pixel_values=torch.cat([p for p, _ in items]) if items else None,
        image_keys=[sha for sha, _ in images] if items else None,
        target_mask=None if all(mask) else mask,
    )
