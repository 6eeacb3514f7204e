"""The format warm start's data carries no information about the images (learner/warmstart.py)."""

from collections import Counter

from broker.schemas import PromptRecord
from learner.warmstart import answer_vocabulary, random_targets, response_text
from tasks.synthetic import verify


def _records(truths: list[str]) -> list[PromptRecord]:
    return [
        PromptRecord(
            prompt_id=f"p{i}",
            data_source="synthetic",
            problem="<image>What colour?",
            images=[],
            ground_truth=t,
            meta={"task": "colour"},
        )
        for i, t in enumerate(truths)
    ]


def test_targets_do_not_depend_on_the_ground_truth_of_a_record():
    truths = ["red", "green", "blue", "yellow"] * 250
    targets = random_targets(_records(truths), seed=3)
    shuffled = truths[1:] + truths[:1]  # every record now shows another colour
    assert random_targets(_records(shuffled), seed=3) == targets
    counts = Counter(targets)
    assert set(counts) == {"red", "green", "blue", "yellow"}
    assert all(200 <= c <= 300 for c in counts.values())  # uniform over the vocabulary
    agree = sum(t == g for t, g in zip(targets, truths)) / len(truths)
    assert 0.20 <= agree <= 0.30  # chance agreement with the truth, nothing more


def test_vocabulary_is_per_question_type_and_the_response_has_the_format():
    records = _records(["red", "blue"]) + [
        PromptRecord(
            prompt_id="c",
            data_source="synthetic",
            problem="x",
            images=[],
            ground_truth="3",
            meta={"task": "count"},
        )
    ]
    assert answer_vocabulary(records) == {"colour": ["blue", "red"], "count": ["3"]}
    text = response_text("blue")
    assert text.startswith("<think>") and "</think>" in text and verify(text, "blue") == 1.0
