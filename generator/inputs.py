"""What the engine takes and gives back, and the admission checks on a prompt before vLLM sees it.

A `Request` carries chat-templated prompt ids with ONE `<|image_pad|>` per image plus the decoded
images (vLLM expands each pad itself). `PromptChecker.check` rejects, with a short reason, every
prompt vLLM would fail on or that would poison training, so one bad prompt never takes a batch
down with it:

    too_long               prompt length after image expansion > max_model_len - max_tokens
    image_count_mismatch   number of image pads != number of images
    too_many_images        more images than the engine reserved room for
    video_pad              a video pad token in the prompt (videos are off)
    empty_prompt           no prompt ids
    bad_image              the image size cannot be processed (e.g. aspect ratio > 200)

The worker adds its own reasons (missing or undecodable image blobs) to the same counter.
`PromptChecker.describe` says what was wrong in words (an image count mismatch names the prompt id
and both counts: `tasks.prompt.check_image_pads`); the worker dead-letters the prompt with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tasks.prompt import ImageCountMismatch, check_image_pads, expanded_length

REASONS = (
    "too_long",
    "image_count_mismatch",
    "too_many_images",
    "video_pad",
    "empty_prompt",
    "bad_image",
    "image_missing",
    "image_undecodable",
    "image_too_large",
)
"""Every rejection reason a generator counts (label values of parallax_generator_rejected_prompts_total)."""


@dataclass
class Request:
    """One prompt to sample a group for."""

    prompt_token_ids: list[int]
    """Chat-templated ids with one image pad per image."""
    images: list = field(default_factory=list)
    """Decoded PIL images, in the order of their pads."""
    split: str = "train"
    """"train" samples with the training parameters; anything else with the evaluation ones."""
    prompt_id: str = ""
    """The record's prompt id (named in rejection details)."""


@dataclass
class Completion:
    """One sampled response."""

    token_ids: list[int]
    logprobs: list[float]
    """Processed logprobs (after the pad ban and temperature) of the sampled tokens."""
    text: str
    finish_reason: str
    """"stop", "length" or "abort"."""


@dataclass
class Result:
    """The outcome of one Request: completions, or the reason it was rejected."""

    completions: list[Completion] = field(default_factory=list)
    version: int = -1
    """Policy version served when the group started (weights never change mid-batch)."""
    version_end: int = -1
    """Policy version served when it finished, if it can differ (continuous loop with in-flight updates)."""
    temperature: float = 1.0
    prompt_len: int = 0
    """Prompt length after image expansion."""
    rejected: str | None = None
    """A reason from REASONS, or None when the group was generated."""
    detail: str = ""
    """What was wrong, in words, when rejected (`PromptChecker.describe`)."""
    seconds: float = 0.0
    """Wall time of the generate call this request was part of."""

    @property
    def ok(self) -> bool:
        return self.rejected is None


class PromptChecker:
    """Admission checks on prompt ids and images (no pixels are processed)."""

    def __init__(
        self,
        image_processor,
        *,
        image_token_id: int,
        video_token_id: int,
        max_prompt_len: int,
        max_images: int,
    ):
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.video_token_id = video_token_id
        self.max_prompt_len = max_prompt_len
        self.max_images = max_images

    def check(self, request: Request) -> tuple[int, str | None]:
        """(expanded prompt length, rejection reason or None)."""
        ids = request.prompt_token_ids
        if not ids:
            return 0, "empty_prompt"
        if self.video_token_id in ids:
            return len(ids), "video_pad"
        try:
            check_image_pads(request.prompt_id, ids, len(request.images), self.image_token_id)
        except ImageCountMismatch:
            return len(ids), "image_count_mismatch"
        if len(request.images) > self.max_images:
            return len(ids), "too_many_images"
        try:
            sizes = [(image.width, image.height) for image in request.images]
            length = expanded_length(len(ids), sizes, self.image_processor)
        except (ValueError, ZeroDivisionError):
            return len(ids), "bad_image"
        if length > self.max_prompt_len:
            return length, "too_long"
        return length, None

    def describe(self, request: Request, reason: str, length: int) -> str:
        """The detail of a rejection: the mismatch with the prompt id and both counts, else the sizes."""
        if reason == "image_count_mismatch":
            try:
                check_image_pads(
                    request.prompt_id, request.prompt_token_ids, len(request.images), self.image_token_id
                )
            except ImageCountMismatch as exc:
                return str(exc)
        return (
            f"prompt {request.prompt_id or '?'}: {len(request.prompt_token_ids)} ids, "
            f"{len(request.images)} images, {length} tokens after expansion"
        )
