"""Load a Qwen2.5-VL processor and model from a local directory (built tiny model or real checkpoint).

The same code loads the checkpoints `policy.builder` writes and real ones such as
Qwen2.5-VL-7B-Instruct on disk: `AutoProcessor` + `AutoModelForImageTextToText`, with the
missing-torchvision compatibility installed first. Nothing is fetched from a hub.
"""

from __future__ import annotations

from pathlib import Path

import torch

from policy import compat
from policy.model_dir import model_dir

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Accept a torch dtype or one of float32/bfloat16/float16 (and fp32/bf16/fp16)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(_DTYPES)}") from None


def load_processor(path: str | Path):
    """The checkpoint's processor (image processor + tokenizer; chat template included)."""
    from transformers import AutoProcessor

    path = model_dir(path)
    compat.install()
    return AutoProcessor.from_pretrained(str(path), local_files_only=True)


def save_processor(processor, path: str | Path) -> None:
    """`processor.save_pretrained(path)`, plus preprocessor_config.json (the image processor's settings alone)
    as the published Qwen checkpoints ship it. Where torchvision is installed (a GPU box), transformers loads
    a video processor too and, when processor_config.json nests none (a processor made where torchvision is
    absent, as here), takes its settings from that file: without it, such a directory does not load there."""
    import json

    processor.save_pretrained(str(path))
    legacy = Path(path) / "preprocessor_config.json"
    if not legacy.exists():
        settings = processor.image_processor.to_dict() | {"processor_class": type(processor).__name__}
        legacy.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def load_tokenizer(path: str | Path):
    """Just the tokenizer (cheaper than the full processor)."""
    from transformers import AutoTokenizer

    path = model_dir(path)
    compat.install()
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
):
    """The checkpoint's `...ForConditionalGeneration` model in eval mode on `device`.

    `attn_implementation` defaults to "sdpa"; pass "flash_attention_2" where flash-attn is installed.
    """
    from transformers import AutoModelForImageTextToText

    path = model_dir(path)
    compat.install()
    model = AutoModelForImageTextToText.from_pretrained(
        str(path),
        dtype=resolve_dtype(dtype),
        local_files_only=True,
        attn_implementation=attn_implementation or "sdpa",
    )
    return model.to(device).eval()
