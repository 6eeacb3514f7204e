"""From scored groups to packed micro-batches: samples, staleness filter, token-budget batching.

* `to_samples` flattens groups into `TrainSample`s, each carrying its group's advantage.
* `validate_group` names what makes a group untrainable (counts that disagree, token ids outside
  the vocabulary, image pads that do not match the images or that a response holds).
* `nonfinite_problem` rejects a group with a NaN/inf reward or behaviour logprob (the inbox
  dead-letters that group alone, before any step sees it).
* `filter_stale` drops samples whose `version_start` is more than K versions behind the
  learner (counted; normally the generators' admission gate already prevents them), and
  samples of versions lost to a crash (`lost` ranges: weights that were discarded when the
  learner restarted from an older checkpoint), which count as stale whatever their number.
* `plan_microbatches` packs sample lengths (prompt incl. expanded image tokens + response)
  into micro-batches under a token budget (first-fit decreasing; an over-long sample goes
  alone), and `assign_to_ranks` spreads them over data-parallel ranks by token load. Every
  rank computes the same plan from the same batch, so no plan is communicated. `join_microbatches`
  joins a rank's consecutive micro-batches into the no-grad passes' bigger packs.
* `PackedMicroBatch.build` turns one micro-batch into a `policy.packing.PackedBatch` plus the
  per-token tensors the loss needs (behaviour logprobs, advantages, sequence index).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from broker.schemas import ImageRef, ScoredGroup
from policy.packing import PackedBatch, PixelCache, make_sample, pack
from tasks.prompt import ImageCountMismatch, check_image_pads


@dataclass
class TrainSample:
    """One response to train on."""

    group_id: str
    prompt_ids: list[int]
    """Prompt ids with ONE image pad per image (as the generator sent them to vLLM)."""
    response_ids: list[int]
    behaviour_logprobs: list[float]
    advantage: float
    version_start: int
    images: list[ImageRef] = field(default_factory=list)
    version_end: int = -1
    """The version serving when the response finished (> version_start after an in-flight update)."""
    reward: float = 0.0
    accuracy: float = 0.0
    data_source: str = ""
    proximal_logprobs: list[float] | None = None
    """Filled by the proximal recompute pass when configured."""
    truncated: bool = False
    """The generator stopped it at its token limit (finish reason "length")."""


def to_samples(groups: Sequence[ScoredGroup], advantages: Sequence[Sequence[float]]) -> list[TrainSample]:
    """Every sample of every group, with its advantage (same order as the groups)."""
    out = []
    for scored, advs in zip(groups, advantages, strict=True):
        g = scored.group
        for sample, score, adv in zip(g.samples, scored.scores, advs, strict=True):
            out.append(
                TrainSample(
                    group_id=g.group_id,
                    prompt_ids=list(g.prompt_token_ids),
                    response_ids=sample.token_ids().tolist(),
                    behaviour_logprobs=sample.logprobs().tolist(),
                    advantage=float(adv),
                    version_start=sample.version_start,
                    version_end=sample.version_end,
                    images=list(g.images),
                    reward=score.reward,
                    accuracy=score.accuracy,
                    data_source=g.data_source,
                    truncated=sample.finish_reason == "length",
                )
            )
    return out


def validate_group(
    scored: ScoredGroup, vocab_size: int | None = None, image_token_id: int | None = None
) -> str | None:
    """Why this scored group cannot be trained on (None when it can); with `image_token_id`, a prompt
    whose image pads and images disagree is named with both counts (`tasks.prompt.check_image_pads`)."""
    g = scored.group
    if not g.samples:
        return "empty"
    if image_token_id is not None:
        try:
            check_image_pads(g.prompt_id, g.prompt_token_ids, len(g.images), image_token_id)
        except ImageCountMismatch as exc:
            return str(exc)
    if len(scored.scores) != len(g.samples):
        return f"{len(scored.scores)} scores for {len(g.samples)} samples"
    for i, s in enumerate(g.samples):
        if not s.num_tokens:
            return f"sample {i} has no response tokens"
        if len(s.behaviour_logprobs_f32) != len(s.response_token_ids_i32):
            return f"sample {i}: {len(s.behaviour_logprobs_f32) // 4} logprobs for {s.num_tokens} tokens"
        if image_token_id is not None and (s.token_ids() == image_token_id).any():
            return f"sample {i}: its response holds image pad tokens (no image stands behind them)"
    if not g.prompt_token_ids:
        return "no prompt tokens"
    if vocab_size is not None:
        ids = np.concatenate(
            [np.asarray(g.prompt_token_ids, dtype=np.int64), *(s.token_ids() for s in g.samples)]
        )
        if ids.min() < 0 or ids.max() >= vocab_size:
            return f"token ids outside the vocabulary [0, {vocab_size})"
    return None


def nonfinite_problem(scored: ScoredGroup) -> str | None:
    """Why this group's numbers cannot be trained on (a non-finite reward or behaviour logprob)."""
    rewards = np.asarray([s.reward for s in scored.scores], dtype=np.float64)
    if not np.isfinite(rewards).all():
        return f"non-finite reward {rewards[~np.isfinite(rewards)][0]}"
    for i, sample in enumerate(scored.group.samples):
        logprobs = sample.logprobs()
        if not np.isfinite(logprobs).all():
            return f"sample {i}: non-finite behaviour logprob {logprobs[~np.isfinite(logprobs)][0]}"
    return None


def staleness(version: int, sample: TrainSample, lost: Sequence[Sequence[int]] = ()) -> int:
    """How many updates behind the learner's `version` the sample's policy was when it started.
    Versions lost to a crash between the two are not updates of the current weights' lineage, and
    neither is the version after a lost range (the restored weights, renumbered: learner/trainer.py)."""
    start = sample.version_start
    skipped = sum(max(0, min(last + 1, version) - max(first, start + 1) + 1) for first, last in lost)
    return version - start - skipped


def in_lost(version: int, lost: Sequence[Sequence[int]]) -> bool:
    """True when `version` lies in one of the inclusive `[first, last]` ranges of lost versions."""
    return any(first <= version <= last for first, last in lost)


def spans_versions(sample: TrainSample) -> bool:
    """True when the policy changed while the response was generated (the generator's in-flight updates)."""
    return sample.version_end > sample.version_start


def filter_stale(
    samples: Sequence[TrainSample],
    version: int,
    max_staleness: int,
    lost: Sequence[Sequence[int]] = (),
) -> tuple[list[TrainSample], int]:
    """Samples no more than `max_staleness` versions old and not of a `lost` version (nor of a
    version the learner never reached), and how many were dropped."""
    kept = [
        s
        for s in samples
        if 0 <= staleness(version, s, lost) <= max_staleness and not in_lost(s.version_start, lost)
    ]
    return kept, len(samples) - len(kept)


def filter_truncated(samples: Sequence[TrainSample]) -> tuple[list[TrainSample], int]:
    """DAPO's overlong filtering: samples cut at the token limit get no loss; returns (kept, masked).
    Their group's advantages were computed with them, so the baseline still sees their reward."""
    kept = [s for s in samples if not s.truncated]
    return kept, len(samples) - len(kept)


def sample_length(sample: TrainSample, image_tokens: Callable[[ImageRef], int]) -> int:
    """Tokens of the packed sequence: prompt with images expanded, plus the response."""
    extra = sum(image_tokens(ref) - 1 for ref in sample.images)
    return len(sample.prompt_ids) + extra + len(sample.response_ids)


def shared_lengths(samples: Sequence[TrainSample], lengths: Sequence[int], max_tokens: int) -> list[int]:
    """What each sample adds to a row with shared prompts, for `plan_microbatches`: a group that fits the
    budget whole (one prompt plus its responses) is planned at exactly what its row computes (the first
    sample carries the prompt); a larger one is split sample by sample, each piece with its own prompt, so
    it is planned at the unshared lengths (never over the budget)."""
    units: dict[Hashable, list[int]] = {}
    for i, s in enumerate(samples):
        units.setdefault(s.group_id, []).append(i)
    out = list(lengths)
    for unit in units.values():
        prompt = lengths[unit[0]] - len(samples[unit[0]].response_ids)
        if prompt + sum(len(samples[i].response_ids) for i in unit) <= max_tokens:
            for i in unit[1:]:
                out[i] = len(samples[i].response_ids)
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
            for ref in s.images:
                warm_pixels(cache, ref, image_bytes)
            images = [(ref.sha256, None) for ref in s.images]
            try:
                packed_samples.append(
                    make_sample(s.prompt_ids, s.response_ids, images, cache, image_token_id)
                )
            except ValueError as exc:  # e.g. image pads that do not match the images
                raise ValueError(f"group {s.group_id}: {exc}") from exc
        packed = pack(
            packed_samples, image_token_id, cache.image_processor.merge_size, share_prompts=share_prompts
        )
        lens = [len(s.response_ids) for s in samples]
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
