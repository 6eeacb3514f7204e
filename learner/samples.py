"""From scored groups to the samples a step trains on: advantages attached, validation, staleness filters.

* `to_samples` flattens groups into `TrainSample`s, each carrying its group's advantage.
* `validate_group` names what makes a group untrainable (counts that disagree, token ids outside
  the vocabulary, image pads that do not match the images or that a response holds).
* `nonfinite_problem` rejects a group with a NaN/inf reward or behaviour logprob (the inbox
  dead-letters that group alone, before any step sees it).
* `filter_stale` drops samples whose `version_start` is more than K versions behind the
  learner (counted; normally the generators' admission gate already prevents them), and
  samples of versions lost to a crash (`lost` ranges: weights that were discarded when the
  learner restarted from an older checkpoint), which count as stale whatever their number.
* `filter_truncated` masks samples cut at the token limit (DAPO's overlong filtering).
The samples that pass go to micro-batch planning (learner/batching.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from broker.schemas import ImageRef, ScoredGroup
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
