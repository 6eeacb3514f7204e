"""Random training inputs in the shapes of a model config, for benches and tests (no data set).

`synthetic_samples(config, n)` gives packing samples (policy/packing.py `PackSample`) with one image
each, random non-special token ids and random pixel patches; `padded_batch` lays the same samples
out right-padded for the transformers reference forward. Ids follow the config's special tokens,
so the config must carry Qwen's vocabulary (presets tiny-fullvocab, qwen2.5-vl-3b, qwen2.5-vl-7b).

    from policy.builder import build_model
    from policy.presets import model_config
    config = model_config("tiny-fullvocab")
    samples = synthetic_samples(config, n=4, seed=0)
"""

from __future__ import annotations

import random

import torch


def synthetic_samples(
    config,
    n: int = 16,
    seed: int = 0,
    text_tokens: int = 96,
    image_side: int = 448,
    response: tuple[int, int] = (256, 1024),
    group_size: int = 1,
):
    """`n` samples: one image_side^2 image, `text_tokens` of text, a random-length response.

    Pixel values are random patches (the model's input after the image processor: (t*h*w,
    3*2*14*14) per image). With `group_size` > 1, consecutive samples form GRPO groups: one prompt
    and image (same `image_keys`), different responses.
    """
    from policy.packing import PackSample

    vc = config.vision_config
    grid = (1, image_side // vc.patch_size, image_side // vc.patch_size)
    n_image = grid[1] * grid[2] // vc.spatial_merge_size**2
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = min(config.text_config.vocab_size, config.text_config.bos_token_id)  # below the added tokens
    samples = []
    for i in range(n):
        if i % max(group_size, 1) == 0:
            before = rng.randint(4, text_tokens - 4)
            prompt = (
                [rng.randrange(vocab) for _ in range(before)]
                + [config.vision_start_token_id]
                + [config.image_token_id] * n_image
                + [config.vision_end_token_id]
                + [rng.randrange(vocab) for _ in range(text_tokens - before - 2)]
            )
            pixels = torch.randn(grid[0] * grid[1] * grid[2], dim, generator=gen)
            key = f"image-{seed}-{i}"
        resp = [rng.randrange(vocab) for _ in range(rng.randint(*response))]
        samples.append(
            PackSample(
                prompt_ids=prompt,
                response_ids=resp,
                image_grid_thw=[grid],
                pixel_values=pixels,
                image_keys=[key],
            )
        )
    return samples


def padded_batch(samples, config, device) -> dict:
    """The samples right-padded into (B, Lmax) for the transformers baseline (positions precomputed)."""
    from policy.mrope import mrope_position_ids

    lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    B, L = len(samples), max(lens)
    ids = torch.full((B, L), config.text_config.pad_token_id, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    pos = torch.ones(3, B, L, dtype=torch.long)
    resp_mask = torch.zeros(B, L, dtype=torch.bool)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        pos[:, i, : len(seq)] = mrope_position_ids(
            seq, s.image_grid_thw, config.image_token_id, config.vision_config.spatial_merge_size
        )[0]
        resp_mask[i, len(s.prompt_ids) : len(seq)] = True
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "position_ids": pos.to(device),
        "pixel_values": torch.cat([s.pixel_values for s in samples]).to(device),
        "image_grid_thw": torch.tensor([g for s in samples for g in s.image_grid_thw], device=device),
        "response_mask": resp_mask.to(device),
        "tokens": sum(lens),
    }


def use_sdpa(model) -> None:
    """Back to transformers' own SDPA attention in both towers (PackedPolicy switches them to varlen)."""
    for cfg in (
        model.config.text_config,
        model.model.language_model.config,
        model.config.vision_config,
        model.model.visual.config,
        model.config,
    ):
        cfg._attn_implementation = "sdpa"


def padded_logprobs(model, batch: dict) -> torch.Tensor:
    """Response-token logprobs of a `padded_batch` in sample order (flattened), fp32: transformers' forward
    with the attention mask, full-vocabulary logits and an fp32 log-softmax (the usual baseline)."""
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        pixel_values=batch["pixel_values"],
        image_grid_thw=batch["image_grid_thw"],
        use_cache=False,
    )
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    token = logp.gather(-1, batch["input_ids"][:, 1:].unsqueeze(-1)).squeeze(-1)
    return token[batch["response_mask"][:, 1:]]
