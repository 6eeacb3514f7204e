"""Build randomly initialised Qwen2.5-VL or Qwen3-VL models of a preset (policy/presets.py), locally.

`build_checkpoint(preset, seed, cache_dir)` writes config.json, generation_config.json,
model.safetensors, the tokenizer files, processor_config.json, preprocessor_config.json and
chat_template into one directory that both transformers and vLLM load. The directory name carries a
hash of the preset, seed and builder version; an existing build is reused. Builds are atomic: they are
written into a temporary sibling directory and renamed into place. `build_model(preset)`
returns the random model in memory (no tokenizer), for benches and tests.

    python -m policy build --preset small                       # into the cache; prints the directory
    python -m policy build --preset qwen2.5-vl-7b --out DIR --device cuda
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

from policy.presets import PRESETS, Preset, get_preset, model_config

log = logging.getLogger(__name__)

BUILDER_VERSION = 4
"""Bump when the builder's output changes for the same preset and seed."""


def default_cache_dir() -> Path:
    """$PARALLAX_CACHE/models, else ~/.cache/parallax/models."""
    root = os.environ.get("PARALLAX_CACHE") or Path.home() / ".cache" / "parallax"
    return Path(root) / "models"


def build_key(preset: str, seed: int) -> str:
    """Content hash of everything that determines the checkpoint."""
    spec = {"preset": dataclasses.asdict(PRESETS[preset]), "seed": seed, "builder": BUILDER_VERSION}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def build_checkpoint(
    preset: str = "tiny",
    seed: int = 0,
    cache_dir: str | Path | None = None,
    out: str | Path | None = None,
    device: str = "cpu",
) -> Path:
    """Return the directory of the preset's checkpoint, building it (on `device`) if needed.

    With `out`, the checkpoint is written exactly there (reused if it holds the same build);
    otherwise under `cache_dir` (default `default_cache_dir()`) in a directory named by hash.
    """
    get_preset(preset)
    key = build_key(preset, seed)
    target = (
        Path(out)
        if out is not None
        else Path(cache_dir or default_cache_dir()) / f"{get_preset(preset).family}-{preset}-s{seed}-{key}"
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
        _write_checkpoint(tmp, preset, seed, device)
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


def build_model(preset: str, device: str = "cpu", dtype=None, seed: int = 0, config=None):
    """A randomly initialised `Qwen2_5_VLForConditionalGeneration` or `Qwen3VLForConditionalGeneration`
    (the preset's family) of `preset`, built on `device`.

    `dtype` defaults to the preset's; `config` defaults to `model_config(preset)`, which needs a
    preset with Qwen's vocabulary.
    """
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration

    from policy import compat

    compat.install()
    config = config if config is not None else model_config(preset)
    dtype = dtype if dtype is not None else getattr(torch, get_preset(preset).dtype)
    previous = torch.get_default_dtype()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model_class = (
                    Qwen3VLForConditionalGeneration
                    if get_preset(preset).family == "qwen3_vl"
                    else Qwen2_5_VLForConditionalGeneration
                )
                model = model_class._from_config(config, attn_implementation="sdpa")
        finally:
            torch.set_default_dtype(previous)
    return model.to(dtype)


def _write_checkpoint(path: Path, name: str, seed: int, device: str) -> None:
    """Tokenizer, processor, config and random weights into `path`."""
    from transformers import GenerationConfig

    from policy import compat
    from policy.loading import save_processor
    from policy.tokenizer import build_full_vocab_tokenizer, build_tokenizer

    compat.install()
    preset = get_preset(name)
    if preset.vocab:
        tokenizer = build_full_vocab_tokenizer(preset.vocab, seed)
    else:
        tokenizer = build_tokenizer(preset.tokenizer_vocab, seed)
    processor = _make_processor(tokenizer, preset)
    model = build_model(name, device, seed=seed, config=_make_config(tokenizer, name, preset.dtype))
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
    save_processor(processor, path)


def _make_processor(tokenizer, preset: Preset):
    """The PIL image processor where torchvision is absent (this CPU stack); with torchvision installed
    (a GPU box) transformers insists on a video processor, so the torchvision pair is built instead.
    Qwen3-VL: patch size 16 (32x32 pixels per image token) and mean = std = 0.5, as its checkpoints."""
    from transformers.models.qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl import Qwen3VLProcessor

    pixels = dict(min_pixels=preset.min_pixels, max_pixels=preset.max_pixels)
    processor_class = Qwen2_5_VLProcessor
    if preset.family == "qwen3_vl":
        pixels.update(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        processor_class = Qwen3VLProcessor
    try:
        return processor_class(
            image_processor=Qwen2VLImageProcessorPil(**pixels),
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
        )
    except TypeError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

        video = Qwen3VLVideoProcessor() if preset.family == "qwen3_vl" else Qwen2VLVideoProcessor()
        return processor_class(
            image_processor=Qwen2VLImageProcessor(**pixels),
            tokenizer=tokenizer,
            video_processor=video,
            chat_template=tokenizer.chat_template,
        )


def _make_config(tokenizer, name: str, dtype: str):
    """The preset's config with the vocabulary size and special-token ids of `tokenizer`."""
    ids = tokenizer.convert_tokens_to_ids
    token_ids = dict(
        bos_token_id=ids("<|endoftext|>"),
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return model_config(name, vocab_size=len(tokenizer), token_ids=token_ids, dtype=dtype)
