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
* `filter_env_failed` drops multi-turn episodes whose environment failed (a timeout or a crash: not the
  policy's doing); `episode_stats` sums the episodes' turns and tool calls for the step's metrics.
A multi-turn episode (docs/environments.md) trains like any sample on its model tokens only: its
`behaviour_logprobs` (and so every per-token tensor of the loss) cover the tokens its `loss_mask` marks
as the model's; the environment's tokens and the tool turns' images are context.
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
    loss_mask: list[int] | None = None
    """Multi-turn episodes: per response token, 1 for the model's and 0 for the environment's (None: every
    token is the model's). `behaviour_logprobs` hold the model's tokens' only."""
    response_images: list[ImageRef] = field(default_factory=list)
    """The images of the episode's tool turns, in the order of their pads in the response."""
    env_error: str = ""
    """Why the environment failed this episode ("" when it did not)."""

    @property
    def loss_tokens(self) -> int:
        """Tokens the loss is computed on (the model's tokens of the response)."""
        return len(self.behaviour_logprobs)


def to_samples(groups: Sequence[ScoredGroup], advantages: Sequence[Sequence[float]]) -> list[TrainSample]:
    """Every sample of every group, with its advantage (same order as the groups)."""
    out = []
    for scored, advs in zip(groups, advantages, strict=True):
        g = scored.group
        for sample, score, adv in zip(g.samples, scored.scores, advs, strict=True):
            mask = sample.loss_mask()
            logprobs = sample.logprobs()[mask.astype(bool)] if sample.multi_turn else sample.logprobs()
            out.append(
                TrainSample(
                    group_id=g.group_id,
                    prompt_ids=list(g.prompt_token_ids),
                    response_ids=sample.token_ids().tolist(),
                    behaviour_logprobs=logprobs.tolist(),
                    advantage=float(adv),
                    version_start=sample.version_start,
                    version_end=sample.version_end,
                    images=list(g.images),
                    reward=score.reward,
                    accuracy=score.accuracy,
                    data_source=g.data_source,
                    truncated=sample.finish_reason == "length",
                    loss_mask=mask.tolist() if sample.multi_turn else None,
                    response_images=list(sample.images),
                    env_error=sample.env_error,
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
        problem = _episode_problem(s, image_token_id)
        if problem:
            return f"sample {i}: {problem}"
    if not g.prompt_token_ids:
        return "no prompt tokens"
    if vocab_size is not None:
        ids = np.concatenate(
            [np.asarray(g.prompt_token_ids, dtype=np.int64), *(s.token_ids() for s in g.samples)]
        )
        if ids.min() < 0 or ids.max() >= vocab_size:
            return f"token ids outside the vocabulary [0, {vocab_size})"
    return None


def _episode_problem(sample, image_token_id: int | None) -> str | None:
    """What makes a sample's response untrainable as an episode: image pads without images behind them,
    a pad marked as the model's, no model token at all."""
    mask = sample.loss_mask()
    if not mask.any():
        return "no model token in its response"
    if image_token_id is None:
        return None
    pads = sample.token_ids() == image_token_id
    if pads.any() and not sample.images:
        return "its response holds image pad tokens (no image stands behind them)"
    if int(pads.sum()) != len(sample.images):
        return f"{int(pads.sum())} image pads in its response but {len(sample.images)} images"
    if mask[pads].any():
        return "an image pad of its response is marked as a model token"
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


def filter_env_failed(samples: Sequence[TrainSample]) -> tuple[list[TrainSample], int]:
    """Episodes whose environment failed (timed out, raised) get no loss; returns (kept, dropped). As with
    truncation, their group's advantages were computed with them."""
    kept = [s for s in samples if not s.env_error]
    return kept, len(samples) - len(kept)


def episode_stats(groups: Sequence[ScoredGroup]) -> dict[str, float]:
    """Per-sample means of a step's multi-turn episodes: turns, tool calls, tool errors, images the tools
    returned, failed environments; {} when no sample of the step is an episode."""
    samples = [s for scored in groups for s in scored.group.samples]
    episodes = [s for s in samples if s.turn_versions or s.multi_turn]
    if not episodes:
        return {}
    n = float(len(samples))
    return {
        "episode_turns": sum(max(len(s.turn_versions), 1) for s in samples) / n,
        "tool_calls_per_sample": sum(s.tool_calls for s in samples) / n,
        "tool_call_rate": sum(s.tool_calls > 0 for s in samples) / n,
        "tool_errors_per_sample": sum(s.tool_errors for s in samples) / n,
        "tool_images_per_sample": sum(len(s.images) for s in samples) / n,
        "env_failed": float(sum(bool(s.env_error) for s in samples)),
    }


def rollout_stats(
    groups: Sequence[ScoredGroup], samples: Sequence[TrainSample], n_stale: int, skipped: dict[str, int]
) -> dict[str, float]:
    """The step's rollout metrics: groups, samples, reward, accuracy, response length, episodes, the
    generator seconds behind the step (each generate call that produced some of its groups, once) and
    the inbox's skip counts (`skipped`)."""
    scores = [s for g in groups for s in g.scores]
    out = {
        "groups": float(len(groups)),
        "samples": float(len(samples)),
        "stale_samples": float(n_stale),
        "reward_mean": sum(s.reward for s in scores) / max(len(scores), 1),
        "accuracy": sum(s.accuracy for s in scores) / max(len(scores), 1),
        "response_len": sum(len(s.response_ids) for s in samples) / max(len(samples), 1),
        **episode_stats(groups),
    }
    calls = {(g.group.generator_id, g.group.timings.get("generate", 0.0)) for g in groups}
    out["generate_s"] = sum(seconds for _, seconds in calls)
    out["generate_calls"] = float(len(calls))
    for reason, count in skipped.items():
        out[f"skipped/{reason}"] = float(count)
    return out
