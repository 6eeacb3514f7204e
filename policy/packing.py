"""Padding-free packing of many (prompt, response, images) samples into one row.

A `PackedBatch` holds every sample back to back in one row of `total` tokens:
input_ids (1, total), M-RoPE position ids (3, 1, total) restarted per sequence, cu_seqlens
(n+1,) sequence boundaries for varlen attention, the indices of response tokens (the targets
of `policy.forward.packed_logprobs`), and the samples' pixel values concatenated with their
image_grid_thw. Nothing is padded.

Prompts arrive with ONE `<|image_pad|>` per image (what the generator sends vLLM);
`expand_image_pads` turns them into processor-expanded ids, and `PixelCache` computes each
image's pixel values once (keyed by its sha256) where they are used.

Images shared by several samples of one pack (every sample of a GRPO group sees its prompt's
image) are stored once: samples that carry `image_keys` are deduplicated by key, the pack holds
each distinct image's pixels once, and `image_index` maps every image occurrence (in row order)
to its distinct image. The forward then runs the vision tower once per distinct image and
reuses its features for every occurrence (autograd sums their gradients): the same result as
encoding every occurrence, for a fraction of the vision FLOPs.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import torch

from policy.mrope import image_token_count, mrope_position_ids


@dataclasses.dataclass
class PackSample:
    """One sequence to pack: processor-expanded prompt ids, response ids and its images' pixels."""

    prompt_ids: list[int]
    """Prompt ids with each image pad expanded to the image's token count."""
    response_ids: list[int]
    """Sampled response token ids (the tokens whose logprobs are wanted)."""
    image_grid_thw: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    """Patch grid (t, h, w) per image, in order of appearance."""
    pixel_values: torch.Tensor | None = None
    """(sum of t*h*w over images, C*T*P*P) patches as the image processor returns them; None: no images."""
    image_keys: list[str] | None = None
    """A content key (the sha256) per image: images with equal keys in one pack are encoded once."""


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
    image_index: torch.Tensor | None = None
    """(n_occurrences,) for each image occurrence in row order, its row in `image_grid_thw` (the distinct
    images); None when every occurrence is its own image."""

    @property
    def num_image_occurrences(self) -> int:
        if self.image_index is not None:
            return int(self.image_index.numel())
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

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


def pack(
    samples: Sequence[PackSample], image_token_id: int, merge: int = 2, dedup_images: bool = True
) -> PackedBatch:
    """Pack samples into one row (order kept); with `dedup_images`, images with equal keys are stored once."""
    if not samples:
        raise ValueError("cannot pack zero samples")
    ids, positions, targets, lens = [], [], [], [0]
    images = _Images(dedup_images)
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
        images.add(s)
    cu = torch.tensor(lens, dtype=torch.int32)
    return PackedBatch(
        input_ids=torch.cat(ids).unsqueeze(0),
        position_ids=torch.cat(positions, dim=1).unsqueeze(1),
        cu_seqlens=cu,
        max_seqlen=int((cu[1:] - cu[:-1]).max()),
        target_index=torch.cat(targets),
        response_lens=[len(s.response_ids) for s in samples],
        prompt_lens=[len(s.prompt_ids) for s in samples],
        **images.fields(),
    )


class _Images:
    """The distinct images of a pack (by key, when samples carry keys) and each occurrence's index."""

    def __init__(self, dedup: bool):
        self.dedup = dedup
        self.grids: list[tuple[int, int, int]] = []
        self.pixels: list[torch.Tensor] = []
        self.index: list[int] = []
        self.by_key: dict[str, int] = {}
        self.shared = False

    def add(self, s: PackSample) -> None:
        if not s.image_grid_thw:
            return
        if s.pixel_values is None:
            raise ValueError("sample has image grids but no pixel values")
        grids = [tuple(int(x) for x in g) for g in s.image_grid_thw]
        sizes = [t * h * w for t, h, w in grids]
        if s.pixel_values.shape[0] != sum(sizes):
            raise ValueError(f"pixel_values has {s.pixel_values.shape[0]} patches, grids need {sum(sizes)}")
        keys = s.image_keys if self.dedup and s.image_keys is not None else [None] * len(grids)
        if len(keys) != len(grids):
            raise ValueError(f"{len(keys)} image keys for {len(grids)} images")
        for grid, key, pixels in zip(grids, keys, torch.split(s.pixel_values, sizes)):
            if key is not None and key in self.by_key:
                known = self.by_key[key]
                if self.grids[known] != grid:
                    raise ValueError(f"image {key} appears with grids {self.grids[known]} and {grid}")
                self.index.append(known)
                self.shared = True
                continue
            if key is not None:
                self.by_key[key] = len(self.grids)
            self.index.append(len(self.grids))
            self.grids.append(grid)
            self.pixels.append(pixels)

    def fields(self) -> dict:
        if not self.grids:
            return {}
        return {
            "pixel_values": torch.cat(self.pixels),
            "image_grid_thw": torch.tensor(self.grids, dtype=torch.long),
            "image_index": torch.tensor(self.index, dtype=torch.long) if self.shared else None,
        }


def expand_image_pads(
    prompt_ids: Sequence[int], image_grid_thw: Sequence[Sequence[int]], image_token_id: int, merge: int = 2
) -> list[int]:
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

    def get(
        self, sha256: str, image_bytes: bytes | None = None, image=None
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
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


def make_sample(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    images: Sequence[tuple[str, bytes | None]],
    cache: PixelCache,
    image_token_id: int,
) -> PackSample:
    """A PackSample from one-pad-per-image prompt ids, response ids and (sha256, bytes) per image."""
    items = [cache.get(sha, data) for sha, data in images]
    grids = [grid for _, grid in items]
    merge = cache.image_processor.merge_size
    return PackSample(
        prompt_ids=expand_image_pads(prompt_ids, grids, image_token_id, merge),
        response_ids=list(response_ids),
        image_grid_thw=grids,
        pixel_values=torch.cat([p for p, _ in items]) if items else None,
        image_keys=[sha for sha, _ in images] if items else None,
    )
