"""Random-weight Qwen2.5-VL-7B / -3B (and a tiny stand-in) from their published configs, plus GPU-bench inputs.

No model hub: the config values below are copied from the published Qwen2.5-VL-{7B,3B}-Instruct
config.json files (text and vision), and the weights are random. Used by the bench/gpu_*.py
scripts and tests/gpu:

    config = qwen_config("7b")                       # Qwen2_5_VLConfig
    model = build_model(config, "cuda", torch.bfloat16)
    samples = synthetic_samples(config, n=16, seed=0)  # 96 text + 256 image + 256-1024 response tokens
    write_checkpoint(config, path)                   # HF dir (random bf16 weights + full-vocab tokenizer) for vLLM

The "tiny" size keeps every structural feature (GQA, M-RoPE sections, windowed + full vision
attention, 448x448 images -> 256 tokens) at toy widths, so the scripts run on CPU with `--tiny`.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

TEXT = {
    "7b": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
    ),
    "3b": dict(
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=1,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}
"""Published text-model shapes (tiny: toy widths, real vocabulary)."""

VISION = {
    "7b": dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=3584,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
    "3b": dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=2048,
        fullatt_block_indexes=[7, 15, 23, 31],
    ),
    "tiny": dict(
        depth=4,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        out_hidden_size=128,
        fullatt_block_indexes=[1, 3],
    ),
}
"""Published vision-tower shapes (shared: patch 14, temporal patch 2, merge 2, window 112)."""

IDS = dict(
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
    image_token_id=151655,
    video_token_id=151656,
    vision_start_token_id=151652,
    vision_end_token_id=151653,
)
"""Qwen2.5-VL's special token ids."""


def qwen_config(size: str):
    """`Qwen2_5_VLConfig` of "7b", "3b" or "tiny" (bf16, sdpa attention)."""
    from transformers import Qwen2_5_VLConfig

    if size not in TEXT:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(TEXT)}")
    text = dict(
        TEXT[size],
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
        use_sliding_window=False,
        bos_token_id=IDS["bos_token_id"],
        eos_token_id=IDS["eos_token_id"],
        pad_token_id=IDS["pad_token_id"],
        dtype="bfloat16",
    )
    if size == "tiny":
        text["rope_parameters"]["mrope_section"] = [8, 12, 12]  # head_dim 64
    vision = dict(
        VISION[size],
        hidden_act="silu",
        in_channels=3,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=IDS["image_token_id"],
        video_token_id=IDS["video_token_id"],
        vision_start_token_id=IDS["vision_start_token_id"],
        vision_end_token_id=IDS["vision_end_token_id"],
        tie_word_embeddings=text["tie_word_embeddings"],
        dtype="bfloat16",
        attn_implementation="sdpa",
    )


def build_model(
    config, device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0
):
    """A randomly initialised `Qwen2_5_VLForConditionalGeneration`, built directly on `device` in `dtype`."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2_5_VLForConditionalGeneration._from_config(config, attn_implementation="sdpa")
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype)


def lm_params(model) -> dict[str, int]:
    """Parameter counts: N_LM as the learner's MFU uses it (no input embedding), and the whole model."""
    from learner.metrics import lm_param_count

    visual = model.model.visual
    return {
        "n_lm": lm_param_count(model),
        "n_total": sum(p.numel() for p in model.parameters()),
        "n_vision": sum(p.numel() for p in visual.parameters()),
    }


def synthetic_samples(
    config,
    n: int = 16,
    seed: int = 0,
    text_tokens: int = 96,
    image_side: int = 448,
    response: tuple[int, int] = (256, 1024),
    group_size: int = 1,
):
    """`n` policy.packing.Samples: one image_side^2 image, `text_tokens` of text, a random-length response.

    Token ids are random non-special ids; pixel values are random patches (the model's input
    after the image processor: (t*h*w, 3*2*14*14) per image). With `group_size` > 1, consecutive
    samples form GRPO groups: one prompt and image (same `image_keys`), different responses.
    """
    from policy.packing import Sample

    vc = config.vision_config
    grid = (1, image_side // vc.patch_size, image_side // vc.patch_size)
    n_image = grid[1] * grid[2] // vc.spatial_merge_size**2
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    vocab = min(config.text_config.vocab_size, IDS["bos_token_id"])
    samples = []
    for i in range(n):
        if i % max(group_size, 1) == 0:
            before = rng.randint(4, text_tokens - 4)
            prompt = (
                [rng.randrange(vocab) for _ in range(before)]
                + [IDS["vision_start_token_id"]]
                + [IDS["image_token_id"]] * n_image
                + [IDS["vision_end_token_id"]]
                + [rng.randrange(vocab) for _ in range(text_tokens - before - 2)]
            )
            pixels = torch.randn(grid[0] * grid[1] * grid[2], dim, generator=gen)
            key = f"image-{seed}-{i}"
        resp = [rng.randrange(vocab) for _ in range(rng.randint(*response))]
        samples.append(
            Sample(
                prompt_ids=prompt,
                response_ids=resp,
                image_grid_thw=[grid],
                pixel_values=pixels,
                image_keys=[key],
            )
        )
    return samples


def padded_batch(samples, config, device) -> dict:
    """The same samples right-padded into (B, Lmax) for the transformers baseline (positions precomputed)."""
    from policy.mrope import mrope_position_ids

    lens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    B, L = len(samples), max(lens)
    ids = torch.full((B, L), IDS["pad_token_id"], dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    pos = torch.ones(3, B, L, dtype=torch.long)
    resp_mask = torch.zeros(B, L, dtype=torch.bool)
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        pos[:, i, : len(seq)] = mrope_position_ids(
            seq, s.image_grid_thw, IDS["image_token_id"], config.vision_config.spatial_merge_size
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


def write_checkpoint(config, path: str | Path, seed: int = 0, device: str = "cuda") -> Path:
    """A Hugging Face checkpoint directory vLLM can load: random bf16 weights, a tokenizer that covers the
    whole vocabulary (random weights sample any id; every id must decode), processor and chat template.

    The tokenizer is policy.tokenizer's locally trained byte-level BPE, with filler tokens appended so
    that its ids run to the model's vocabulary, and Qwen's special tokens placed at Qwen's own ids.
    """
    path = Path(path)
    if (path / "parallax_gpu_build.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = full_vocab_tokenizer(config.text_config.vocab_size)
    from transformers import GenerationConfig

    from policy.builder import Preset, _make_processor

    model = build_model(config, device, torch.bfloat16, seed)
    model.generation_config = GenerationConfig(
        bos_token_id=IDS["bos_token_id"],
        eos_token_id=[IDS["eos_token_id"]],
        pad_token_id=IDS["pad_token_id"],
        do_sample=True,
        temperature=1.0,
    )
    model.save_pretrained(path)
    del model
    preset = Preset(
        tokenizer_vocab=0,
        hidden=0,
        layers=0,
        heads=0,
        kv_heads=0,
        ffn=0,
        vision_depth=0,
        vision_hidden=0,
        vision_heads=0,
        vision_ffn=0,
        min_pixels=56 * 56,
        max_pixels=448 * 448,
    )
    processor = _make_processor(tokenizer, preset)
    processor.save_pretrained(path)
    (path / "parallax_gpu_build.json").write_text(json.dumps({"seed": seed}))
    return path


def full_vocab_tokenizer(vocab_size: int):
    """A Qwen2Tokenizer whose ids cover 0..vocab_size-1 with Qwen's special tokens at 151643.."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    from policy.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, train_bpe

    vocab, merges = train_bpe(2000, seed=0)
    special_base = IDS["bos_token_id"]
    i = 0
    while (
        len(vocab) < special_base
    ):  # unreachable filler tokens (no merge produces them); they decode to text
        token = f"w{i}"
        if token not in vocab:
            vocab[token] = len(vocab)
        i += 1
    for k, (token, _) in enumerate(SPECIAL_TOKENS):
        vocab[token] = special_base + k
    while len(vocab) < vocab_size:
        vocab[f"x{len(vocab)}"] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=32768,
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=s, normalized=False) for t, s in SPECIAL_TOKENS if not s], special_tokens=False
    )
    tokenizer.add_special_tokens(
        {
            "additional_special_tokens": [
                t for t, s in SPECIAL_TOKENS if s and t not in ("<|endoftext|>", "<|im_end|>")
            ]
        }
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
