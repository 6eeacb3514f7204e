"""The missing-torchvision compatibility: active only without torchvision, and it fixes what it claims."""

from __future__ import annotations

import subprocess
import sys

import pytest

from policy import compat


def test_torchvision_is_unusable_here_so_patches_apply():
    # On this CPU stack torchvision is uninstalled; if someone installs a working one, the patches stay off.
    assert compat.needed() == (not compat.torchvision_usable())


def test_install_is_noop_when_torchvision_works(monkeypatch):
    monkeypatch.setattr(compat, "_installed", False)
    monkeypatch.setattr(compat, "torchvision_usable", lambda: True)
    assert compat.install() is False


@pytest.mark.skipif(compat.torchvision_usable(), reason="torchvision works here: no patches needed")
def test_smart_resize_resolves_to_pil_implementation():
    compat.install()
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as pil_resize
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    assert smart_resize is pil_resize
    assert smart_resize(300, 200, factor=28, min_pixels=56 * 56, max_pixels=224 * 224) == pil_resize(
        300, 200, factor=28, min_pixels=56 * 56, max_pixels=224 * 224
    )


@pytest.mark.skipif(compat.torchvision_usable(), reason="torchvision works here: no patches needed")
def test_without_compat_the_vllm_import_fails_and_with_it_succeeds():
    code = "import transformers.models.qwen2_vl.image_processing_qwen2_vl"
    bare = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert bare.returncode != 0 and "torchvision" in bare.stderr
    fixed = subprocess.run(
        [
            sys.executable,
            "-c",
            "from policy import compat; compat.install(); "
            + code
            + "\nfrom transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize"
            + "\nprint('ok')",
        ],
        capture_output=True,
        text=True,
    )
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.strip() == "ok"


@pytest.mark.skipif(compat.torchvision_usable(), reason="torchvision works here: no patches needed")
def test_processor_saves_and_loads_with_image_processor_and_tokenizer_only(tiny_model_dir, tmp_path):
    from policy.loading import load_processor

    processor = load_processor(tiny_model_dir)
    assert type(processor).get_attributes() == ["image_processor", "tokenizer"]
    stand_in = processor.video_processor
    assert isinstance(stand_in, compat.VideoProcessorStandIn)
    assert "min_pixels" in stand_in.valid_kwargs.__annotations__ or stand_in.valid_kwargs.__annotations__
    assert stand_in.merge_size == processor.image_processor.merge_size
    with pytest.raises(NotImplementedError):
        stand_in([])
    processor.save_pretrained(tmp_path)
    assert "video_processor" not in (tmp_path / "processor_config.json").read_text()
    (tmp_path / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    again = load_processor(tmp_path)
    assert again.tokenizer.get_vocab() == processor.tokenizer.get_vocab()
    assert again.image_processor.size == processor.image_processor.size


def test_install_is_idempotent():
    assert compat.install() == compat.install()


def test_the_shim_is_registered_as_a_vllm_plugin_so_spawned_workers_get_it():
    """`./run setup` installs the project (editable), registering the entry point vLLM runs per process."""
    from importlib.metadata import entry_points

    import policy.compat

    plugins = {e.value: e for e in entry_points(group="vllm.general_plugins")}
    assert "policy.compat:vllm_plugin" in plugins
    assert plugins["policy.compat:vllm_plugin"].load() is policy.compat.vllm_plugin
