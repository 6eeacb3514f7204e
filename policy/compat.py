"""Compatibility for machines where torchvision cannot be imported (the CPU install, docs/install.md).

PyPI's torchvision builds are linked against CUDA torch and fail to import beside the CPU
build of torch. Three things then break, and this module fixes
all three in one place, and only when torchvision is missing:

1. `transformers.models.qwen2_vl.image_processing_qwen2_vl` imports torchvision at the top,
   yet vLLM's Qwen2-VL model file imports `smart_resize` from it. We register a stand-in
   module that re-exports the PIL implementation (same resizing arithmetic).
2. `Qwen2_5_VLProcessor` (and `Qwen2VLProcessor`, `Qwen3VLProcessor`) insist on a video processor, which needs
   torchvision: construction, saving and loading fail. We limit their sub-processors to
   image processor + tokenizer.
3. vLLM reads `processor.video_processor.valid_kwargs`: we attach a small stand-in object
   that describes (but cannot run) the video processor.

`install()` is idempotent and cheap. Where it must run:
- transformers: `policy.loading` calls it before building a processor or model;
- vLLM: call `install_vllm()` before constructing `LLM` (it also registers the Qwen-VL model
  classes in-process, so vLLM's architecture inspection does not run in a fresh subprocess);
- vLLM's forked workers inherit the patched modules from their parent;
- spawned workers: vLLM calls every `vllm.general_plugins` entry point in each of its
  processes; pyproject.toml registers `vllm_plugin` below there (active once the project is
  pip-installed, e.g. `pip install --no-deps -e .`).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from typing import Any

log = logging.getLogger(__name__)

_STANDIN_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_installed = False


def torchvision_usable() -> bool:
    """True when torchvision is installed AND imports (a CUDA-linked build beside CPU torch does not)."""
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means unusable
        return False
    return True


def needed() -> bool:
    """Whether the compatibility patches apply on this machine."""
    return not torchvision_usable()


def install() -> bool:
    """Apply the patches if torchvision is unusable. Returns True when the patches are active."""
    global _installed
    if _installed:
        return True
    if not needed():
        return False
    _install_smart_resize_standin()
    _limit_processor_to_images()
    _installed = True
    log.debug("torchvision missing: Qwen2-VL compatibility patches installed")
    return True


def install_vllm() -> bool:
    """`install()`, then register vLLM's Qwen-VL model classes in-process.

    vLLM inspects a model architecture in a fresh subprocess (`python -m
    vllm.model_executor.models.registry`) that does not have our patches unless the
    `vllm.general_plugins` entry point is installed. Registering the classes themselves makes
    vLLM inspect them in this process instead. Call before constructing `vllm.LLM`.
    """
    active = install()
    if not active:
        return False
    from vllm import ModelRegistry
    from vllm.model_executor.models import qwen2_5_vl, qwen2_vl, qwen3_vl

    ModelRegistry.register_model(
        "Qwen2_5_VLForConditionalGeneration", qwen2_5_vl.Qwen2_5_VLForConditionalGeneration
    )
    ModelRegistry.register_model("Qwen2VLForConditionalGeneration", qwen2_vl.Qwen2VLForConditionalGeneration)
    ModelRegistry.register_model("Qwen3VLForConditionalGeneration", qwen3_vl.Qwen3VLForConditionalGeneration)
    return True


def vllm_plugin() -> None:
    """Entry point for vLLM's `vllm.general_plugins` group (vLLM runs it in each of its processes)."""
    install()


def _install_smart_resize_standin() -> None:
    """Make the torchvision-backed image-processing module resolve to the PIL implementation."""
    existing = sys.modules.get(_STANDIN_MODULE)
    if existing is not None and hasattr(existing, "smart_resize"):
        return
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    standin = types.ModuleType(_STANDIN_MODULE)
    standin.__doc__ = "Parallax stand-in (policy.compat): PIL-backed Qwen2-VL image processing."
    standin.smart_resize = pil.smart_resize
    standin.Qwen2VLImageProcessorKwargs = pil.Qwen2VLImageProcessorKwargs
    standin.__all__ = ["smart_resize", "Qwen2VLImageProcessorKwargs"]
    sys.modules[_STANDIN_MODULE] = standin


class VideoProcessorStandIn:
    """Describes Qwen2-VL's video processor for callers that only inspect it (vLLM).

    Calling it raises: videos are not supported without torchvision.
    """

    def __init__(self, image_processor: Any) -> None:
        from transformers.processing_utils import VideosKwargs

        self.valid_kwargs = VideosKwargs
        self.merge_size = getattr(image_processor, "merge_size", 2)
        self.patch_size = getattr(image_processor, "patch_size", 14)
        self.temporal_patch_size = getattr(image_processor, "temporal_patch_size", 2)
        self.size = dict(getattr(image_processor, "size", {}) or {})
        self.model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("video inputs need torchvision, which cannot be imported here")

    def __repr__(self) -> str:
        return "VideoProcessorStandIn()"


def _limit_processor_to_images() -> None:
    """Make the Qwen-VL processors take only image processor + tokenizer; expose a stand-in video processor.

    The replaced `__init__` has no `video_processor` parameter, so transformers' signature-based
    sub-processor discovery (used to construct, save and load) no longer asks for one. The stand-in
    is a class property, so it is never serialised.
    """
    from transformers.models.qwen2_5_vl import processing_qwen2_5_vl
    from transformers.models.qwen2_vl import processing_qwen2_vl
    from transformers.models.qwen3_vl import processing_qwen3_vl

    classes = (
        processing_qwen2_5_vl.Qwen2_5_VLProcessor,
        processing_qwen2_vl.Qwen2VLProcessor,
        processing_qwen3_vl.Qwen3VLProcessor,
    )
    for cls in classes:
        if cls.__dict__.get("_parallax_compat", False):
            continue
        original_init = cls.__init__

        def __init__(
            self, image_processor=None, tokenizer=None, chat_template=None, _orig=original_init, **kwargs
        ):
            kwargs.pop("video_processor", None)
            _orig(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

        cls.__init__ = __init__
        cls.video_processor = property(lambda self: VideoProcessorStandIn(self.image_processor))
        cls._parallax_compat = True
