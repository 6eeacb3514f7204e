"""Build a randomly initialised Qwen2.5-VL checkpoint in Hugging Face format, locally.

`build_tiny_model(preset, seed, cache_dir)` writes config.json, generation_config.json,
model.safetensors, the tokenizer files, processor_config.json and chat_template into one
directory that both transformers and vLLM load. The directory name carries a hash of the
preset, seed and builder version; an existing build is reused. Builds are atomic: they are
written into a temporary sibling directory and renamed into place.

Presets:
- tiny  (~1 M parameters): unit tests; builds in seconds.
- small (~5 M parameters): the CPU learning demo (learns an image-only task in minutes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

BUILDER_VERSION = 2
"""Bump when the builder's output changes for the same preset and seed."""


@dataclasses.dataclass(frozen=True)
class Preset:
    """Shapes of one model preset."""

    tokenizer_vocab: int
    """Target BPE vocabulary size including the 22 added tokens (the trained vocabulary may be smaller)."""
    hidden: int
    """Text model hidden size."""
    layers: int
    """Number of decoder layers."""
    heads: int
    """Attention heads (head_dim = hidden / heads)."""
    kv_heads: int
    """Key/value heads (grouped-query attention)."""
    ffn: int
    """MLP intermediate size."""
    vision_depth: int
    """Vision transformer blocks."""
    vision_hidden: int
    """Vision transformer width."""
    vision_heads: int
    """Vision attention heads."""
    vision_ffn: int
    """Vision MLP intermediate size."""
    min_pixels: int = 56 * 56
    """Image processor lower bound on resized pixels."""
    max_pixels: int = 224 * 224
    """Image processor upper bound on resized pixels (224x224 -> 64 image tokens)."""


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        tokenizer_vocab=2048,
        hidden=128,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=256,
        vision_depth=2,
        vision_hidden=64,
        vision_heads=2,
        vision_ffn=128,
    ),
    "small": Preset(
        tokenizer_vocab=2048,
        hidden=256,
        layers=4,
        heads=4,
        kv_heads=2,
        ffn=768,
        vision_depth=4,
        vision_hidden=128,
        vision_heads=4,
        vision_ffn=256,
    ),
}


def default_cache_dir() -> Path:
    """$PARALLAX_CACHE/models, else ~/.cache/parallax/models."""
    root = os.environ.get("PARALLAX_CACHE") or Path.home() / ".cache" / "parallax"
    return Path(root) / "models"


def mrope_section(head_dim: int) -> list[int]:
    """Temporal/height/width split of the rotary frequencies; sums to head_dim/2 (Qwen: 128 -> [16, 24, 24])."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def build_key(preset: str, seed: int) -> str:
    """Content hash of everything that determines the checkpoint."""
    spec = {"preset": dataclasses.asdict(PRESETS[preset]), "seed": seed, "builder": BUILDER_VERSION}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def build_tiny_model(
    preset: str = "tiny", seed: int = 0, cache_dir: str | Path | None = None, out: str | Path | None = None
) -> Path:
    """Return the directory of the preset's checkpoint, building it if needed.

    With `out`, the checkpoint is written exactly there (reused if it holds the same build);
    otherwise under `cache_dir` (default `default_cache_dir()`) in a directory named by hash.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    key = build_key(preset, seed)
    target = (
        Path(out)
        if out is not None
        else Path(cache_dir or default_cache_dir()) / f"qwen2_5_vl-{preset}-s{seed}-{key}"
    )
    stamp = target / "parallax_build.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("key") == key:
        return target
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(
            f"{target} exists and does not hold build {key}; remove it or pick another path"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_checkpoint(tmp, PRESETS[preset], seed)
        (tmp / "parallax_build.json").write_text(json.dumps({"key": key, "preset": preset, "seed": seed}))
        if target.exists():
            target.rmdir()
        os.rename(tmp, target)
    except OSError:
        if stamp.exists():  # another process won the race with the same build
            shutil.rmtree(tmp, ignore_errors=True)
            return target
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("built %s model (seed %d) at %s", preset, seed, target)
    return target


def _write_checkpoint(path: Path, preset: Preset, seed: int) -> None:
    """Tokenizer, processor, config and random weights into `path`."""
    import torch
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration

    from policy import compat
    from policy.tokenizer import build_tokenizer

    compat.install()
    tokenizer = build_tokenizer(preset.tokenizer_vocab, seed)
    processor = _make_processor(tokenizer, preset)
    config = _make_config(tokenizer, preset)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=[
            tokenizer.convert_tokens_to_ids("<|im_end|>"),
            tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        ],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )
    model.save_pretrained(path)
    processor.save_pretrained(path)


def _make_processor(tokenizer, preset: Preset):
    """The PIL image processor where torchvision is absent (this CPU stack); with torchvision installed
    (a GPU box) transformers insists on a video processor, so the torchvision pair is built instead."""
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    pixels = dict(min_pixels=preset.min_pixels, max_pixels=preset.max_pixels)
    try:
        return Qwen2_5_VLProcessor(
            image_processor=Qwen2VLImageProcessorPil(**pixels),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
    except TypeError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        return Qwen2_5_VLProcessor(
            image_processor=Qwen2VLImageProcessor(**pixels),
            tokenizer=tokenizer,
            video_processor=Qwen2VLVideoProcessor(),
            chat_template=tokenizer.chat_template,
        )


def _make_config(tokenizer, preset: Preset):
    from transformers import Qwen2_5_VLConfig

    ids = tokenizer.convert_tokens_to_ids
    head_dim = preset.hidden // preset.heads
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=preset.hidden,
        intermediate_size=preset.ffn,
        num_hidden_layers=preset.layers,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "mrope_section": mrope_section(head_dim), "rope_theta": 1e6},
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    vision = dict(
        depth=preset.vision_depth,
        hidden_size=preset.vision_hidden,
        num_heads=preset.vision_heads,
        intermediate_size=preset.vision_ffn,
        out_hidden_size=preset.hidden,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[preset.vision_depth - 1],
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=False,
        dtype="float32",
    )
