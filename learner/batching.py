"""Micro-batch planning: one step's trained samples into PPO mini-batches of packed micro-batches per rank.

    planner = MicroBatchPlanner(cfg, info, processor, images, pixels, image_token_id)   # the Learner's
    plans = planner.plan_step(samples)      # [MiniBatch], the same plan on every rank
    updater.run(plans, values, ...)         # learner/update.py runs the passes over it

`plan_step` on one step's samples (learner/samples.py):
  1. each sample's packed length (`sample_length`: prompt with its images expanded, plus the response);
  2. the samples split into `algo.mini_batches` contiguous, nearly equal mini-batches (`split_evenly`);
  3. per mini-batch (`plan_mini_batch`): with `batching.share_prompts` each sample counts what it adds to a
     row where its group's prompt is once (`shared_lengths`); the lengths are packed into micro-batches of
     at most `batching.max_tokens_per_microbatch` tokens (`plan_microbatches`: first-fit decreasing, a
     group kept together when it fits, an over-long sample alone) and spread over the data-parallel ranks
     by token load (`assign_to_ranks`); this rank's micro-batches are packed (`PackedMicroBatch.build`:
     a `policy.packing.PackedBatch` plus the per-token tensors the loss needs), and consecutive ones are
     joined into the no-grad passes' bigger packs (`join_microbatches`,
     `batching.no_grad_tokens_per_microbatch`).
Every rank computes the same plan from the same samples, so no plan is communicated; a rank with fewer
micro-batches or packs than another runs zero-weighted dummies (`MicroBatchPlanner.dummy`) so that FSDP's
collectives line up.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from broker.schemas import ImageRef
from learner.losses import loss_denominator
from learner.samples import TrainSample
from policy.packing import PackedBatch, PixelCache, make_sample, pack
from policy.turns import make_turn_sample
from tasks.prompt import num_image_tokens


@dataclass
class MiniBatch:
    """One PPO mini-batch as this rank runs it (`MicroBatchPlanner.plan_mini_batch`)."""

    mine: list[PackedMicroBatch]
    """This rank's training micro-batches."""
    n_micro: int
    """Micro-batches every rank runs (a rank with fewer runs zero-weighted dummies)."""
    denom: float
    """The loss denominator of the whole mini-batch (learner.losses.loss_denominator)."""
    no_grad: list[tuple[PackedMicroBatch, list[PackedMicroBatch]]]
    """This rank's no-grad packs, each with the training micro-batches whose samples it holds, in order
    (`batching.no_grad_tokens_per_microbatch`; without it, each micro-batch is its own pack)."""
    n_no_grad: int
    """No-grad packs every rank runs."""


class MicroBatchPlanner:
    """Plans a step's samples for this rank (see the module docstring). `images` (broker.images.ImageStore)
    and `pixels` (policy.packing.PixelCache) give the pixels of a sample's images; `info` (learner.parallel.
    DistInfo) says which of the ranks' plans is this one's."""

    def __init__(self, cfg, info, processor, images, pixels: PixelCache, image_token_id: int):
        self.cfg, self.info = cfg, info
        self.processor, self.images, self.pixels = processor, images, pixels
        self.image_token_id = image_token_id

    def plan_step(self, samples: list[TrainSample]) -> list[MiniBatch]:
        """The step's `algo.mini_batches` contiguous mini-batches of `samples`, each planned."""
        lengths = [sample_length(s, self.image_tokens) for s in samples]
        chunks = split_evenly(len(samples), self.cfg.algo.mini_batches)
        return [self.plan_mini_batch([samples[i] for i in c], [lengths[i] for i in c]) for c in chunks]

    def plan_mini_batch(self, samples: list[TrainSample], lengths: list[int]) -> MiniBatch:
        """One mini-batch's micro-batches (the same plan on every rank) and its no-grad packs."""
        batching = self.cfg.batching
        budget = batching.max_tokens_per_microbatch
        if batching.share_prompts:  # what each sample adds to a row where its group's prompt is once
            responses = [response_length(s, self.image_tokens) for s in samples]
            lengths = shared_lengths(samples, lengths, budget, responses)
        bins = plan_microbatches(lengths, budget, [s.group_id for s in samples])
        per_rank = assign_to_ranks(bins, lengths, self.info.world_size)
        mine = [self.build_micro_batch([samples[i] for i in b]) for b in per_rank[self.info.rank]]
        n_resp = sum(s.loss_tokens for s in samples)
        denom = loss_denominator(self.cfg.loss, n_resp, len(samples))
        # bigger packs for the passes that keep no activations (a budget of 0 joins nothing)
        joined = [join_microbatches(r, lengths, batching.no_grad_tokens_per_microbatch) for r in per_rank]
        no_grad = []
        for part in joined[self.info.rank]:
            parts = [mine[j] for j in part]
            pack = parts[0]
            if len(parts) > 1:
                pack = self.build_micro_batch([s for mb in parts for s in mb.samples])
            no_grad.append((pack, parts))
        n_micro, n_no_grad = max(len(r) for r in per_rank), max(len(r) for r in joined)
        return MiniBatch(mine, n_micro, denom, no_grad, n_no_grad)

    def build_micro_batch(self, samples: list[TrainSample]) -> PackedMicroBatch:
        """`samples` as one packed micro-batch (prompts once per group with `batching.share_prompts`)."""
        share = self.cfg.batching.share_prompts
        return PackedMicroBatch.build(samples, self.images.get, self.pixels, self.image_token_id, share)

    def dummy(self) -> PackedMicroBatch:
        """A one-token micro-batch whose loss is multiplied by zero (keeps FSDP collectives aligned)."""
        tok = int(self.processor.tokenizer.pad_token_id or 0)
        sample = TrainSample(
            group_id="",
            prompt_ids=[tok],
            response_ids=[tok],
            behaviour_logprobs=[0.0],
            advantage=0.0,
            version_start=0,
        )
        return self.build_micro_batch([sample])

    def image_tokens(self, ref: ImageRef) -> int:
        """Tokens `ref`'s image expands to: from its size where the record gives it, else from its pixels."""
        if ref.width and ref.height:
            return num_image_tokens(self.processor.image_processor, ref.width, ref.height)
        pixels, grid = self.pixels.get(ref.sha256, self.images.get(ref))
        return grid[0] * grid[1] * grid[2] // self.processor.image_processor.merge_size**2


def split_evenly(n: int, parts: int) -> list[list[int]]:
    """0..n-1 in `parts` contiguous, nearly equal chunks (empty chunks dropped)."""
    size = math.ceil(n / max(parts, 1))
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)] if n else []


def sample_length(sample: TrainSample, image_tokens: Callable[[ImageRef], int]) -> int:
    """Tokens of the packed sequence: prompt with images expanded, plus the response (with its tool
    turns' images expanded)."""
    extra = sum(image_tokens(ref) - 1 for ref in sample.images)
    return len(sample.prompt_ids) + extra + response_length(sample, image_tokens)


def response_length(sample: TrainSample, image_tokens: Callable[[ImageRef], int]) -> int:
    """Tokens of the packed response: its ids with the tool turns' images expanded."""
    return len(sample.response_ids) + sum(image_tokens(ref) - 1 for ref in sample.response_images)


def shared_lengths(
    samples: Sequence[TrainSample],
    lengths: Sequence[int],
    max_tokens: int,
    responses: Sequence[int] | None = None,
) -> list[int]:
    """What each sample adds to a row with shared prompts, for `plan_microbatches`: a group that fits the
    budget whole (one prompt plus its responses) is planned at exactly what its row computes (the first
    sample carries the prompt); a larger one is split sample by sample, each piece with its own prompt, so
    it is planned at the unshared lengths (never over the budget). `responses`: each sample's packed response
    length (`response_length`; default: its ids)."""
    if responses is None:
        responses = [len(s.response_ids) for s in samples]
    units: dict[Hashable, list[int]] = {}
    for i, s in enumerate(samples):
        units.setdefault(s.group_id, []).append(i)
    out = list(lengths)
    for unit in units.values():
        prompt = lengths[unit[0]] - responses[unit[0]]
        if prompt + sum(responses[i] for i in unit) <= max_tokens:
            for i in unit[1:]:
                out[i] = responses[i]
    return out


def plan_microbatches(
    lengths: Sequence[int], max_tokens: int, groups: Sequence[Hashable] | None = None
) -> list[list[int]]:
    """Indices grouped into micro-batches of at most `max_tokens` tokens (first-fit decreasing).

    With `groups` (a key per index, e.g. the GRPO group id), the samples of one group go into one
    micro-batch whenever the whole group fits in one, so that their shared image is encoded once
    (policy.packing); a group larger than the budget is placed sample by sample.
    """
    if max_tokens <= 0:
        raise ValueError("max_tokens must be > 0")
    units: dict[Hashable, list[int]] = {}
    for i in range(len(lengths)):
        units.setdefault(i if groups is None else ("g", groups[i]), []).append(i)
    whole = [u for u in units.values() if sum(lengths[i] for i in u) <= max_tokens]
    split = [[i] for u in units.values() if sum(lengths[i] for i in u) > max_tokens for i in u]
    items = [(sum(lengths[i] for i in u), min(u), u) for u in whole + split]
    bins: list[list[int]] = []
    loads: list[int] = []
    for size, _, unit in sorted(items, key=lambda item: (-item[0], item[1])):
        for b, load in enumerate(loads):
            if load + size <= max_tokens:
                bins[b].extend(unit)
                loads[b] += size
                break
        else:
            bins.append(list(unit))
            loads.append(size)
    return [sorted(b) for b in bins]


def join_microbatches(bins: Sequence[list[int]], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive micro-batches (`bins`, lists of sample indices) joined while their planned tokens stay
    within `max_tokens` (0: none joined): positions in `bins`, in order (the no-grad passes' bigger packs)."""
    joined: list[list[int]] = []
    load = max_tokens + 1
    for b, bin_ in enumerate(bins):
        size = sum(lengths[i] for i in bin_)
        if load + size > max_tokens:
            joined.append([])
            load = 0
        joined[-1].append(b)
        load += size
    return joined


def assign_to_ranks(
    bins: Sequence[list[int]], lengths: Sequence[int], world_size: int
) -> list[list[list[int]]]:
    """Micro-batches per rank, heaviest first onto the least loaded rank (deterministic)."""
    per_rank: list[list[list[int]]] = [[] for _ in range(world_size)]
    heap = [(0, r) for r in range(world_size)]
    order = sorted(range(len(bins)), key=lambda b: (-sum(lengths[i] for i in bins[b]), b))
    for b in order:
        load, r = heapq.heappop(heap)
        per_rank[r].append(bins[b])
        heapq.heappush(heap, (load + sum(lengths[i] for i in bins[b]), r))
    return per_rank


@dataclass
class PackedMicroBatch:
    """One packed micro-batch and the per-response-token inputs of the loss."""

    packed: PackedBatch
    samples: list[TrainSample]
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    seq_index: torch.Tensor
    proximal_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None = None
    """log π_ref from the reference model's pass (KL penalty), when configured."""

    @property
    def has_images(self) -> bool:
        return self.packed.pixel_values is not None

    @property
    def num_tokens(self) -> int:
        """Tokens the row computes (fewer than the samples' own with shared prompts)."""
        return self.packed.num_tokens

    @staticmethod
    def build(
        samples: Sequence[TrainSample],
        image_bytes: Callable[[ImageRef], bytes],
        cache: PixelCache,
        image_token_id: int,
        share_prompts: bool = False,
    ) -> PackedMicroBatch:
        """Pack `samples` (fetching and processing each image once per cache; prompts once per group with
        `share_prompts`)."""
        packed_samples = []
        for s in samples:
            for ref in (*s.images, *s.response_images):
                warm_pixels(cache, ref, image_bytes)
            images = [(ref.sha256, None) for ref in (*s.images, *s.response_images)]
            try:
                if s.loss_mask is None and not s.response_images:
                    sample = make_sample(s.prompt_ids, s.response_ids, images, cache, image_token_id)
                else:  # a multi-turn episode: its model tokens are the targets
                    sample = make_turn_sample(
                        s.prompt_ids, s.response_ids, s.loss_mask, images, cache, image_token_id
                    )
                packed_samples.append(sample)
            except ValueError as exc:  # e.g. image pads that do not match the images
                raise ValueError(f"group {s.group_id}: {exc}") from exc
        packed = pack(
            packed_samples, image_token_id, cache.image_processor.merge_size, share_prompts=share_prompts
        )
        lens = [s.loss_tokens for s in samples]
        if lens != packed.response_lens:
            raise ValueError(f"behaviour logprobs for {lens} tokens but {packed.response_lens} targets")
        prox = None
        if all(s.proximal_logprobs is not None for s in samples):
            prox = torch.tensor([x for s in samples for x in s.proximal_logprobs], dtype=torch.float32)
        return PackedMicroBatch(
            packed=packed,
            samples=list(samples),
            behaviour_logprobs=torch.tensor(
                [x for s in samples for x in s.behaviour_logprobs], dtype=torch.float32
            ),
            advantages=torch.tensor(
                [s.advantage for s, n in zip(samples, lens) for _ in range(n)], dtype=torch.float32
            ),
            seq_index=torch.repeat_interleave(torch.arange(len(samples)), torch.tensor(lens)),
            proximal_logprobs=prox,
        )


def warm_pixels(cache: PixelCache, ref: ImageRef, image_bytes: Callable[[ImageRef], bytes]) -> None:
    """Make sure the cache holds `ref`'s pixels, fetching its bytes only on a miss (raises when unusable)."""
    try:
        cache.get(ref.sha256)
    except KeyError:
        cache.get(ref.sha256, image_bytes(ref))
