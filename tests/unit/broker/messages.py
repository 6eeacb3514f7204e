"""Realistic example messages of every kind, shared by the broker tests."""

from __future__ import annotations

from broker.schemas import (
    ImageRef,
    PromptRecord,
    Rollout,
    RolloutGroup,
    Score,
    ScoredGroup,
    WeightVersion,
)

IMAGE = ImageRef(sha256="ab" * 32, format="png", width=224, height=224, nbytes=100_000)


def rollout_group(group_id: str = "g-0", n: int = 2, tokens: int = 8) -> RolloutGroup:
    samples = [
        Rollout.of(
            token_ids=list(range(i, i + tokens)),
            logprobs=[-0.5 - 0.01 * t for t in range(tokens)],
            response_text=f"<think>look</think> \\boxed{{{i}}}",
            version_start=3,
            version_end=4,
            finish_reason="stop",
        )
        for i in range(n)
    ]
    return RolloutGroup(
        group_id=group_id,
        prompt_id="p-1",
        data_source="geometry3k",
        prompt_token_ids=[1, 2, 151655, 3],
        images=[IMAGE],
        ground_truth="42",
        samples=samples,
        timings={"generate": 0.25},
    )


def every_message() -> list:
    group = rollout_group()
    return [
        PromptRecord(
            prompt_id="p-1",
            data_source="geometry3k",
            problem="<image>Find x.",
            images=[IMAGE],
            ground_truth="42",
            meta={"level": "3"},
        ),
        group,
        ScoredGroup(group=group, scores=[Score(reward=1.0, accuracy=1.0, format=1.0)] * 2, scorer_id="r-0"),
        WeightVersion(version=7, step=7, source="learner", num_bytes=1 << 20, seconds=0.5, timestamp=1.0),
    ]
