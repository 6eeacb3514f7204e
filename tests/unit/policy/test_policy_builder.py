"""The tiny-model builder: files, shapes, determinism, caching, tokenizer and chat template, CLI."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from policy.builder import build_checkpoint, build_key
from policy.presets import PRESETS, interleaved_mrope_section, mrope_section
from policy.tokenizer import SPECIAL_TOKENS


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_checkpoint_files_and_config(tiny_model_dir):
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "processor_config.json",
        "preprocessor_config.json",
        "generation_config.json",
        "chat_template.jinja",
    ):
        assert (tiny_model_dir / name).is_file(), name
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    text = config["text_config"]
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    assert sum(text["rope_parameters"]["mrope_section"]) == head_dim // 2
    assert config["vision_config"]["out_hidden_size"] == text["hidden_size"]


def test_a_video_processor_finds_its_settings_as_in_a_published_checkpoint(family_model_dir):
    """Where torchvision is installed (the GPU image), loading the processor loads a video processor too,
    whose settings come from processor_config.json's nested entry or preprocessor_config.json. A build made
    without torchvision (the CPU install) nests none: the legacy file must be there (else the GPU stack's
    versions, `./run test-gpu-stack`, fail on a model cache built by the CPU install)."""
    from transformers.video_processing_utils import BaseVideoProcessor

    settings, _ = BaseVideoProcessor.get_video_processor_dict(str(family_model_dir))
    image = json.loads((family_model_dir / "processor_config.json").read_text())["image_processor"]
    for key in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std"):
        assert settings[key] == image[key], key


@pytest.mark.parametrize("head_dim,expected", [(128, [16, 24, 24]), (32, [4, 6, 6]), (64, [8, 12, 12])])
def test_mrope_section_sums_to_half_head_dim(head_dim, expected):
    assert mrope_section(head_dim) == expected


def test_tiny_has_about_a_million_parameters(tiny_model):
    n = sum(p.numel() for p in tiny_model.parameters())
    assert 0.5e6 < n < 2e6


def test_tokenizer_special_tokens_roundtrip_and_chat_template(tiny_processor):
    tok = tiny_processor.tokenizer
    ids = [tok.convert_tokens_to_ids(t) for t, _ in SPECIAL_TOKENS]
    assert len(set(ids)) == 22 and None not in ids and tok.unk_token_id not in ids[1:]
    assert ids == list(range(ids[0], ids[0] + 22))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for text in [
        "<think> 3 red circles </think> \\boxed{3}",
        "héllo 中文 \t\n x^2=\\frac{1}{2}",
        "blue square 17",
    ]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|image_pad|>") == [tok.convert_tokens_to_ids("<|image_pad|>")]
    rendered = tiny_processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        "<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_build_is_deterministic_by_seed_and_cached(tmp_path, tiny_model_dir):
    a = build_checkpoint("tiny", seed=0, cache_dir=tmp_path)
    assert a.name == tiny_model_dir.name
    assert _sha(a / "model.safetensors") == _sha(tiny_model_dir / "model.safetensors")
    assert _sha(a / "tokenizer.json") == _sha(tiny_model_dir / "tokenizer.json")
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert build_checkpoint("tiny", seed=0, cache_dir=tmp_path) == a
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    b = build_checkpoint("tiny", seed=1, cache_dir=tmp_path)
    assert b != a and _sha(b / "model.safetensors") != _sha(a / "model.safetensors")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary dirs left


def test_build_key_depends_on_preset_and_seed():
    keys = {build_key(p, s) for p in PRESETS for s in (0, 1)}
    assert len(keys) == 2 * len(PRESETS)


def test_unknown_preset_and_foreign_out_dir_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        build_checkpoint("huge", cache_dir=tmp_path)
    (tmp_path / "occupied").mkdir()
    (tmp_path / "occupied" / "x").write_text("mine")
    with pytest.raises(FileExistsError):
        build_checkpoint("tiny", out=tmp_path / "occupied")
    assert (tmp_path / "occupied" / "x").read_text() == "mine"


def test_cli_build_into_out_dir(tmp_path, tiny_model_dir):
    out = tmp_path / "model"
    run = subprocess.run(
        [sys.executable, "-m", "policy", "build", "--preset", "tiny", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().endswith(str(out))
    assert _sha(out / "model.safetensors") == _sha(tiny_model_dir / "model.safetensors")


def test_qwen3_vl_checkpoint_is_chosen_from_its_config(family_model_dir, family_processor, family_model):
    config = json.loads((family_model_dir / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    if config["model_type"] == "qwen2_5_vl":
        assert type(family_model).__name__ == "Qwen2_5_VLForConditionalGeneration"
        assert family_processor.image_processor.patch_size == vision["patch_size"] == 14
        return
    assert config["model_type"] == "qwen3_vl"
    assert config["architectures"] == ["Qwen3VLForConditionalGeneration"]
    assert type(family_model).__name__ == "Qwen3VLForConditionalGeneration"
    assert type(family_processor).__name__ == "Qwen3VLProcessor"
    assert family_processor.image_processor.patch_size == vision["patch_size"] == 16
    assert family_processor.image_processor.merge_size == vision["spatial_merge_size"] == 2
    rope = text["rope_parameters"]
    assert rope["mrope_interleaved"] is True and sum(rope["mrope_section"]) == text["head_dim"] // 2
    assert vision["deepstack_visual_indexes"] == [0, 1] and text["num_hidden_layers"] == 3
    assert hasattr(family_model.model.language_model.layers[0].self_attn, "q_norm")


@pytest.mark.parametrize("head_dim,expected", [(128, [24, 20, 20]), (32, [6, 5, 5]), (64, [12, 10, 10])])
def test_interleaved_mrope_section_matches_qwen3_vl(head_dim, expected):
    assert interleaved_mrope_section(head_dim) == expected
