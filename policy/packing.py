"""Padding-free packing of many (prompt, response, images) samples into one row.

A `PackedBatch` holds every sample back to back in one row of `total` tokens:
input_ids (1, total), M-RoPE position ids (3, 1, total) restarted per sequence, cu_seqlens
(n+1,) sequence boundaries for varlen attention, the indices of response tokens (the targets
of `policy.forward.packed_logprobs`), and the samples' pixel values concatenated with their
image_grid_thw. Nothing is padded.

Prompts arrive with ONE `<|image_pad|>` per image (what the generator sends vLLM);
`expand_image_pads` turns them into processor-expanded ids, and `PixelCache` computes each
image's pixel values once (keyed by its sha256) where they are used.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import torch

from policy.mrope import image_token_count, mrope_position_ids


@dataclasses.dataclass
class Sample:
    """One sequence to pack: processor-expanded prompt ids, response ids and its images' pixels."""

    prompt_ids: list[int]
    """Prompt ids with each image pad expanded to the image's token count."""
    response_ids: list[int]
    """Sampled response token ids (the tokens whose logprobs are wanted)."""
    image_grid_thw: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    """Patch grid (t, h, w) per image, in order of appearance."""
    pixel_values: torch.Tensor | None = None
    """(sum of t*h*w over images, C*T*P*P) patches as the image processor returns them; None without images."""


@dataclasses.dataclass
class PackedBatch:
    """Many samples as one padding-free row (see module docstring)."""

    input_ids: torch.Tensor
    """(1, total) token ids."""
    position_ids: torch.Tensor
    """(3, 1, total) M-RoPE positions, restarted at 0 for each sequence."""
    cu_seqlens: torch.Tensor
    """(n+1,) int32 cumulative sequence lengths: sequence i spans [cu[i], cu[i+1])."""
    max_seqlen: int
    """Longest sequence in the pack."""
    target_index: torch.Tensor
    """(N,) positions of response tokens in the row; their logits come from position index-1."""
    response_lens: list[int]
    """Response tokens per sample (split the N per-token outputs with these)."""
    prompt_lens: list[int]
    """Prompt tokens per sample."""
    pixel_values: torch.Tensor | None = None
    """All samples' image patches concatenated in order; None when the pack has no image."""
    image_grid_thw: torch.Tensor | None = None
    """(n_images, 3) grids in the same order."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on `device` (pixel values keep their dtype)."""
        move = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in move.items():
            if torch.is_tensor(value):
                move[name] = value.to(device, non_blocking=True)
        return PackedBatch(**move)

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Per-sample views of an (N, ...) per-response-token tensor."""
        return list(torch.split(values, self.response_lens))


def pack(samples: Sequence[Sample], image_token_id: int, merge: int = 2) -> PackedBatch:
    """Pack samples into one row (order preserved)."""
    if not samples:
        raise ValueError("cannot pack zero samples")
    ids, positions, targets, lens, grids, pixels = [], [], [], [0], [], []
    offset = 0
    for s in samples:
        if not s.response_ids:
            raise ValueError("every sample needs at least one response token")
        seq = list(s.prompt_ids) + list(s.response_ids)
        pos, _ = mrope_position_ids(seq, s.image_grid_thw, image_token_id, merge)
        n_prompt = len(s.prompt_ids)
        ids.append(torch.as_tensor(seq, dtype=torch.long))
        positions.append(pos)
        targets.append(torch.arange(offset + n_prompt, offset + len(seq)))
        offset += len(seq)
        lens.append(offset)
        grids.extend(tuple(int(x) for x in g) for g in s.image_grid_thw)
        if s.image_grid_thw:
            if s.pixel_values is None:
                raise ValueError("sample has image grids but no pixel values")
            want = sum(int(t) * int(h) * int(w) for t, h, w in s.image_grid_thw)
            if s.pixel_values.shape[0] != want:
                raise ValueError(f"pixel_values has {s.pixel_values.shape[0]} patches, grids need {want}")
            pixels.append(s.pixel_values)
    cu = torch.tensor(lens, dtype=torch.int32)
    return PackedBatch(
        input_ids=torch.cat(ids).unsqueeze(0),
        position_ids=torch.cat(positions, dim=1).unsqueeze(1),
        cu_seqlens=cu,
        max_seqlen=int((cu[1:] - cu[:-1]).max()),
        target_index=torch.cat(targets),
        response_lens=[len(s.response_ids) for s in samples],
        prompt_lens=[len(s.prompt_ids) for s in samples],
        pixel_values=torch.cat(pixels) if pixels else None,
        image_grid_thw=torch.tensor(grids, dtype=torch.long) if grids else None,
    )


def expand_image_pads(prompt_ids: Sequence[int], image_grid_thw: Sequence[Sequence[int]], image_token_id: int,
                      merge: int = 2) -> list[int]:
    """Replace the i-th single image pad with image i's token count of pads."""
    pads = [i for i, t in enumerate(prompt_ids) if t == image_token_id]
    if len(pads) != len(image_grid_thw):
        raise ValueError(f"{len(pads)} image pads in the prompt but {len(image_grid_thw)} images")
    out: list[int] = []
    cursor = 0
    for index, grid in zip(pads, image_grid_thw):
        out.extend(prompt_ids[cursor:index])
        out.extend([image_token_id] * image_token_count(grid, merge))
        cursor = index + 1
    out.extend(prompt_ids[cursor:])
    return out


class PixelCache:
    """Pixel values and grid of each image, computed once per sha256 (LRU bounded by bytes)."""

    def __init__(self, image_processor, max_bytes: int = 1 << 30):
        self.image_processor = image_processor
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, tuple[torch.Tensor, tuple[int, int, int]]] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def get(self, sha256: str, image_bytes: bytes | None = None, image=None) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(pixel_values, grid_thw) of one image; pass its encoded bytes (or a PIL image) on a miss."""
        if sha256 in self._items:
            self.hits += 1
            self._items.move_to_end(sha256)
            return self._items[sha256]
        self.misses += 1
        if image is None:
            if image_bytes is None:
                raise KeyError(f"image {sha256} is not cached and no bytes were given")
            image = _decode(image_bytes)
        out = self.image_processor(images=[image], return_tensors="pt")
        item = (out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0]))
        self._items[sha256] = item
        self._bytes += item[0].numel() * item[0].element_size()
        while self._bytes > self.max_bytes and len(self._items) > 1:
            _, old = self._items.popitem(last=False)
            self._bytes -= old[0].numel() * old[0].element_size()
        return item


def _decode(data: bytes):
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def make_sample(prompt_ids: Sequence[int], response_ids: Sequence[int], images: Sequence[tuple[str, bytes | None]],
                cache: PixelCache, image_token_id: int) -> Sample:
    """A Sample from one-pad-per-image prompt ids, response ids and (sha256, bytes) per image."""
    items = [cache.get(sha, data) for sha, data in images]
    grids = [grid for _, grid in items]
    merge = cache.image_processor.merge_size
    return Sample(
        prompt_ids=expand_image_pads(prompt_ids, grids, image_token_id, merge),
        response_ids=list(response_ids),
        image_grid_thw=grids,
        pixel_values=torch.cat([p for p, _ in items]) if items else None,
    )
