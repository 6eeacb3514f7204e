"""The task instruction and the rendering of a prompt record into chat-templated token ids.

`render_prompt_ids` gives the ids with ONE `<|image_pad|>` per image inside
`<|vision_start|>...<|vision_end|>` (what vLLM takes, together with the images). The learner
expands each pad to the image's token count (`policy.packing.expand_image_pads`);
`expanded_length` predicts that length without processing pixels, for length filtering.
`check_image_pads` is the one check that a prompt's image pads and its images agree (the
generator's admission and the learner's inbox both run it).
"""

from __future__ import annotations

import math

INSTRUCTION = (
    " You FIRST think about the reasoning process as an internal monologue and then provide the final "
    "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
    "BE put in \\boxed{}."
)
"""EasyR1's math.jinja / veRL's geo3k instruction: think in <think> </think>, answer in \\boxed{}."""

SHORT_INSTRUCTION = " Think inside <think> </think>, then put the answer in \\boxed{}."
"""A shorter form of the same format, for tasks whose prompts must stay small (the CPU demo)."""

IMAGE_PLACEHOLDER = "<image>"
IMAGE_PAD = "<|image_pad|>"


class ImageCountMismatch(ValueError):
    """A prompt whose image pads and images disagree in number."""


def check_image_pads(prompt_id: str, prompt_ids, n_images: int, image_token_id: int) -> None:
    """Raise `ImageCountMismatch`, naming the prompt and both counts, unless the prompt ids hold
    exactly one image pad per image (what vLLM takes and the learner expands)."""
    pads = sum(1 for t in prompt_ids if t == image_token_id)
    if pads != n_images:
        raise ImageCountMismatch(
            f"prompt {prompt_id or '?'}: {pads} image pads in the prompt ids but {n_images} images"
        )


def with_instruction(problem: str, instruction: str = INSTRUCTION) -> str:
    """The problem text (trimmed) followed by the think-then-box instruction."""
    return problem.strip() + instruction


def build_messages(problem: str, n_images: int) -> list[dict]:
    """One user message whose content interleaves images at the `<image>` placeholders.

    Images without a placeholder go first (Qwen's convention), in order.
    """
    parts = problem.split(IMAGE_PLACEHOLDER)
    placeholders = len(parts) - 1
    if placeholders > n_images:
        raise ValueError(f"{placeholders} {IMAGE_PLACEHOLDER} placeholders but only {n_images} images")
    content: list[dict] = [{"type": "image"} for _ in range(n_images - placeholders)]
    for i, text in enumerate(parts):
        if i > 0:
            content.append({"type": "image"})
        if text:
            content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def render_prompt_text(processor_or_tokenizer, problem: str, n_images: int) -> str:
    """Chat-templated prompt text ending with the assistant turn's header."""
    text = processor_or_tokenizer.apply_chat_template(
        build_messages(problem, n_images), add_generation_prompt=True, tokenize=False
    )
    if text.count(IMAGE_PAD) != n_images:
        raise ValueError(f"chat template produced {text.count(IMAGE_PAD)} image pads for {n_images} images")
    return text


def render_prompt_ids(processor_or_tokenizer, problem: str, n_images: int) -> list[int]:
    """Prompt token ids with exactly one `<|image_pad|>` per image."""
    tokenizer = getattr(processor_or_tokenizer, "tokenizer", processor_or_tokenizer)
    ids = tokenizer.encode(
        render_prompt_text(processor_or_tokenizer, problem, n_images), add_special_tokens=False
    )
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    if sum(1 for i in ids if i == pad) != n_images:
        raise ValueError("tokenizer did not keep <|image_pad|> as one token per image")
    return ids


def image_grid(image_processor, width: int, height: int) -> tuple[int, int, int]:
    """(t, h, w) patch grid the Qwen2-VL image processor gives an image of this size."""
    patch = image_processor.patch_size
    factor = patch * image_processor.merge_size
    size = image_processor.size
    min_pixels = size.get("shortest_edge", size.get("min_pixels"))
    max_pixels = size.get("longest_edge", size.get("max_pixels"))
    h, w = _smart_resize(height, width, factor, min_pixels, max_pixels)
    return 1, h // patch, w // patch


def num_image_tokens(image_processor, width: int, height: int) -> int:
    """How many `<|image_pad|>` tokens one image of this size expands to."""
    t, h, w = image_grid(image_processor, width, height)
    return t * h * w // image_processor.merge_size**2


def expanded_length(n_prompt_ids: int, image_sizes: list[tuple[int, int]], image_processor) -> int:
    """Prompt length after image expansion, from the one-pad-per-image length and (width, height)s."""
    return n_prompt_ids + sum(num_image_tokens(image_processor, w, h) - 1 for w, h in image_sizes)


def _smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize arithmetic (transformers' smart_resize), kept here to avoid importing it."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {width}x{height} exceeds 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
