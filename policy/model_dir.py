"""Check a model path before anything loads it: a clear error instead of a Hugging Face hub lookup.

Parallax loads checkpoints from local directories only (no hub downloads). transformers and vLLM
treat a path that does not exist as a hub repository id and fail with a misleading network
error, so every entry point calls `model_dir(cfg.model)` first (it imports no torch):

    from policy.model_dir import model_dir
    model_dir("/models/Qwen2.5-VL-7B-Instruct")   # Path, or ModelDirError naming the path
"""

from __future__ import annotations

from pathlib import Path


class ModelDirError(FileNotFoundError):
    """The model path is empty, missing, or not a Hugging Face checkpoint directory."""


def model_dir(path: str | Path) -> Path:
    """`path` as a Path if it is a checkpoint directory (holds config.json); else ModelDirError."""
    if not str(path):
        raise ModelDirError("no model given: pass --model DIR (a Hugging Face checkpoint directory)")
    p = Path(path)
    if not p.exists():
        raise ModelDirError(f"model {p}: no such directory (models load from local directories only)")
    if not (p / "config.json").is_file():
        raise ModelDirError(f"model {p}: not a Hugging Face checkpoint directory (no config.json)")
    return p
