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

`share_prompts` goes further: samples with the same prompt (the same ids and image keys: the
responses of one GRPO group) put that prompt into the row once, followed by each response. The
row is cut into query pieces (the prompt; each response) and every piece attends to its keys
through `kv_index`: the prompt to itself, a response to the prompt and then itself, causal and
aligned at the end (flash-attn's varlen convention when there are more keys than queries). A
response's positions continue from its prompt's, and its first token is predicted from the
prompt's last position (`state_index`). Logprobs, entropies and gradients are those of the
unshared row; its linear layers compute the prompt once instead of once per response.
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
    target_mask: list[bool] | None = None
    """Multi-turn samples (policy/turns.py): per response token, True where its logprob is wanted (the
    model's tokens), False for the environment's (tool turns, their image tokens); None: every token."""

    @property
    def targets(self) -> int:
        """Response tokens whose logprobs are wanted."""
        return len(self.response_ids) if self.target_mask is None else sum(map(bool, self.target_mask))


@dataclasses.dataclass
class PackedBatch:
    """Many samples as one padding-free row (see module docstring)."""

    input_ids: torch.Tensor
    """(1, total) token ids."""
    position_ids: torch.Tensor
    """(3, 1, total) M-RoPE positions, restarted at 0 for each sequence."""
    cu_seqlens: torch.Tensor
    """(n+1,) int32 boundaries of the row's query pieces: piece i spans [cu[i], cu[i+1]). A piece is a
    sequence (prompt + response), or with shared prompts a prompt or a response."""
    max_seqlen: int
    """Longest query piece in the pack."""
    target_index: torch.Tensor
    """(N,) positions of response tokens in the row; their logits come from position index-1."""
    response_lens: list[int]
    """Target tokens per sample (split the N per-token outputs with these): the whole response, or its
    model tokens where a sample has a `target_mask`."""
    prompt_lens: list[int]
    """Prompt tokens per sample."""
    sequence_lens: list[int] = dataclasses.field(default_factory=list)
    """Prompt + response tokens per sample (environment tokens included)."""
    pixel_values: torch.Tensor | None = None
    """All samples' image patches concatenated in order; None when the pack has no image."""
    image_grid_thw: torch.Tensor | None = None
    """(n_images, 3) grids in the same order."""
    image_index: torch.Tensor | None = None
    """(n_occurrences,) for each image occurrence in row order, its row in `image_grid_thw` (the distinct
    images); None when every occurrence is its own image."""
    state_index: torch.Tensor | None = None
    """(N,) the row position whose hidden state predicts each target (shared prompts); None: target - 1."""
    kv_index: torch.Tensor | None = None
    """(T_k,) shared prompts: for each query piece in turn, the row positions of the keys it attends to
    (its prompt, then itself); None: every piece of `cu_seqlens` attends to itself."""
    cu_seqlens_k: torch.Tensor | None = None
    """(n+1,) int32 boundaries of each query piece's keys in `kv_index` (None with it)."""
    max_seqlen_k: int = 0
    """Most keys of one query piece (with `kv_index`)."""

    @property
    def num_image_occurrences(self) -> int:
        if self.image_index is not None:
            return int(self.image_index.numel())
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    @property
    def num_tokens(self) -> int:
        """Tokens in the row (what the model computes)."""
        return int(self.input_ids.shape[1])

    @property
    def sequence_tokens(self) -> int:
        """Prompt + response tokens of every sample (the row's length unless prompts are shared)."""
        return sum(self.sequence_lens)

    def causal_area(self) -> int:
        """Query-key pairs of causal attention, counted as a full square per sequence (what attention FLOP
        estimates use): a prompt piece P^2, a response piece after it (P+R)^2 - P^2."""
        q = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()
        cu_k = self.cu_seqlens_k if self.cu_seqlens_k is not None else self.cu_seqlens
        k = (cu_k[1:] - cu_k[:-1]).tolist()
        return sum(kk * kk - (kk - qq) ** 2 for qq, kk in zip(q, k))

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
    samples: Sequence[PackSample],
    image_token_id: int,
    merge: int = 2,
    dedup_images: bool = True,
    share_prompts: bool = False,
) -> PackedBatch:
    """Pack samples into one row (outputs in sample order); with `dedup_images`, images with equal keys are
    stored once; with `share_prompts`, samples with equal prompts share one copy of it (module docstring)."""
    if not samples:
        raise ValueError("cannot pack zero samples")
    if any(not s.response_ids or not s.targets for s in samples):
        raise ValueError("every sample needs at least one response token (and one target among them)")
    images = _Images(dedup_images)
    row = _Row(share_prompts)
    targets: list = [None] * len(samples)
    states: list = [None] * len(samples)
    for segment in _segments(samples, share_prompts, image_token_id, merge):
        first = samples[segment[0]]
        if len(segment) == 1:  # prompt + response as one piece, attending to itself
            images.add(first)
            seq = list(first.prompt_ids) + list(first.response_ids)
            at = row.piece(seq, mrope_position_ids(seq, first.image_grid_thw, image_token_id, merge)[0])
            response = torch.arange(at + len(first.prompt_ids), row.length)
            targets[segment[0]] = _masked(response, first)
            states[segment[0]] = targets[segment[0]] - 1
            continue
        n_prompt = prompt_images(first, image_token_id, merge)
        images.add(first, stop=n_prompt)
        grids = first.image_grid_thw[:n_prompt]
        positions, start = mrope_position_ids(first.prompt_ids, grids, image_token_id, merge)
        prompt = (row.piece(list(first.prompt_ids), positions), row.length)
        for i in segment:  # responses continue the prompt's positions (text after it: +1 per token)
            s = samples[i]
            ids = list(s.response_ids)
            images.add(s, start=n_prompt)
            at = row.piece(ids, _response_positions(s, start, image_token_id, merge), keys_before=prompt)
            previous = torch.cat([torch.tensor([prompt[1] - 1]), torch.arange(at, row.length - 1)])
            targets[i] = _masked(torch.arange(at, row.length), s)
            states[i] = _masked(previous, s)
    return PackedBatch(
        input_ids=torch.tensor(row.ids, dtype=torch.long).unsqueeze(0),
        position_ids=torch.cat(row.positions, dim=1).unsqueeze(1),
        cu_seqlens=torch.tensor(row.cu_q, dtype=torch.int32),
        max_seqlen=max(b - a for a, b in zip(row.cu_q, row.cu_q[1:])),
        target_index=torch.cat(targets),
        response_lens=[len(t) for t in targets],
        prompt_lens=[len(s.prompt_ids) for s in samples],
        sequence_lens=[len(s.prompt_ids) + len(s.response_ids) for s in samples],
        **images.fields(),
        **(row.shared_fields(torch.cat(states)) if share_prompts else {}),
    )


def _masked(positions: torch.Tensor, sample: PackSample) -> torch.Tensor:
    """The row `positions` of the sample's response tokens (or their predecessors) that are targets."""
    if sample.target_mask is None:
        return positions
    if len(sample.target_mask) != len(sample.response_ids):
        raise ValueError(
            f"a target mask of {len(sample.target_mask)} for {len(sample.response_ids)} response tokens"
        )
    return positions[torch.tensor(sample.target_mask, dtype=torch.bool)]


def prompt_images(sample: PackSample, image_token_id: int, merge: int) -> int:
    """How many of the sample's images stand in its prompt (the rest are in its response: tool turns)."""
    tokens = sum(1 for t in sample.prompt_ids if t == image_token_id)
    count = 0
    for grid in sample.image_grid_thw:
        if tokens <= 0:
            break
        tokens -= image_token_count(grid, merge)
        count += 1
    if tokens != 0:
        raise ValueError("the prompt's image tokens do not end at an image's last token")
    return count


def _response_positions(sample: PackSample, start: int, image_token_id: int, merge: int) -> torch.Tensor:
    """(3, R) positions of a response after its prompt: text counts on from `start`; a response holding
    images (tool turns) gets its positions from the whole sequence, as transformers' get_rope_index does."""
    ids = list(sample.response_ids)
    if image_token_id not in ids:
        return torch.arange(start, start + len(ids)).expand(3, -1)
    seq = list(sample.prompt_ids) + ids
    return mrope_position_ids(seq, sample.image_grid_thw, image_token_id, merge)[0][
        :, len(sample.prompt_ids) :
    ]


def _segments(samples: Sequence[PackSample], share: bool, image_token_id: int, merge: int) -> list[list[int]]:
    """Sample indices by prompt, in order of first appearance (each its own unless `share`). Images count
    as equal only by key: a sample with images but no keys shares with nothing. A prompt is its ids and
    the keys of its own images (a multi-turn response's images are that response's)."""
    segments: dict = {}
    for i, s in enumerate(samples):
        if not share or (s.image_grid_thw and s.image_keys is None):
            key = ("own", i)
        else:
            keys = (s.image_keys or [])[: prompt_images(s, image_token_id, merge)]
            key = (tuple(s.prompt_ids), tuple(keys))
        segments.setdefault(key, []).append(i)
    return list(segments.values())


class _Row:
    """The row as it is laid out: ids and positions, query pieces, and (`with_keys`) each piece's keys."""

    def __init__(self, with_keys: bool):
        self.with_keys = with_keys
        self.ids: list[int] = []
        self.positions: list[torch.Tensor] = []
        self.cu_q, self.cu_k = [0], [0]
        self.keys: list[torch.Tensor] = []

    @property
    def length(self) -> int:
        return len(self.ids)

    def piece(
        self, ids: list[int], positions: torch.Tensor, keys_before: tuple[int, int] | None = None
    ) -> int:
        """Append a query piece attending to [keys_before) then itself; returns where it starts."""
        at = self.length
        self.ids.extend(ids)
        self.positions.append(positions)
        self.cu_q.append(self.length)
        if self.with_keys:
            own = torch.arange(at, self.length)
            self.keys.append(own if keys_before is None else torch.cat([torch.arange(*keys_before), own]))
            self.cu_k.append(self.cu_k[-1] + len(self.keys[-1]))
        return at

    def shared_fields(self, states: torch.Tensor) -> dict:
        lens = [b - a for a, b in zip(self.cu_k, self.cu_k[1:])]
        return {
            "state_index": states,
            "kv_index": torch.cat(self.keys),
            "cu_seqlens_k": torch.tensor(self.cu_k, dtype=torch.int32),
            "max_seqlen_k": max(lens),
        }


class _Images:
    """The distinct images of a pack (by key, when samples carry keys) and each occurrence's index."""

    def __init__(self, dedup: bool):
        self.dedup = dedup
        self.grids: list[tuple[int, int, int]] = []
        self.pixels: list[torch.Tensor] = []
        self.index: list[int] = []
        self.by_key: dict[str, int] = {}
        self.shared = False

    def add(self, s: PackSample, start: int = 0, stop: int | None = None) -> None:
        """The sample's images [start, stop) (a shared prompt's images, or a response's), in row order."""
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
        chosen = slice(start, stop)
        for grid, key, pixels in zip(grids[chosen], keys[chosen], torch.split(s.pixel_values, sizes)[chosen]):
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
