"""Loading the built checkpoint with transformers through policy.loading (vLLM: test_policy_vllm.py)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from policy.loading import load_model, load_processor, resolve_dtype


def _image_prompt(processor):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour?"}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_transformers_loads_processor_and_model_and_generates(tiny_model_dir, tiny_processor, tiny_model):
    image = Image.new("RGB", (224, 224), (255, 0, 0))
    enc = tiny_processor(text=[_image_prompt(tiny_processor)], images=[image], return_tensors="pt")
    pad = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert enc["image_grid_thw"].tolist() == [[1, 16, 16]]
    assert int((enc["input_ids"] == pad).sum()) == 64  # 224x224 -> 16x16 patches -> 64 merged tokens
    torch.manual_seed(0)
    out = tiny_model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == enc["input_ids"].shape[1] + 4
    assert next(tiny_model.parameters()).dtype == torch.float32


def test_load_model_in_bfloat16(tiny_model_dir):
    model = load_model(tiny_model_dir, dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_bad_paths_and_dtypes_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_processor(tmp_path)
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8")
