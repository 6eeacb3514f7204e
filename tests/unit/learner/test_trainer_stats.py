"""The per-step rollout statistics the learner logs (metrics.jsonl), on hand-made groups."""

from broker.schemas import RolloutGroup, Score, ScoredGroup
from learner.samples import rollout_stats


def _group(generator_id: str, generate_s: float, rewards=(1.0, 0.0)) -> ScoredGroup:
    group = RolloutGroup(
        group_id=f"{generator_id}-{generate_s}-{rewards}",
        prompt_id="p",
        data_source="synthetic",
        prompt_token_ids=[1, 2],
        images=[],
        ground_truth="red",
        samples=[],
        generator_id=generator_id,
        timings={"generate": generate_s},
    )
    return ScoredGroup(group=group, scores=[Score(reward=r, accuracy=r, format=1.0) for r in rewards])


def test_generate_seconds_count_each_generate_call_once():
    groups = [
        _group("gen-a", 1.5),
        _group("gen-a", 1.5, (0.0, 0.0)),
        _group("gen-a", 0.5),
        _group("gen-b", 1.5),
    ]
    stats = rollout_stats(groups, [], 0, {})
    assert stats["generate_calls"] == 3.0  # gen-a's call shared by two groups counts once
    assert stats["generate_s"] == 3.5
    assert stats["reward_mean"] == 3 / 8 and stats["groups"] == 4.0


def test_the_gpu_peak_is_the_high_water_mark_since_the_step_began(monkeypatch):
    import torch

    from learner.metrics import gpu_peak, track_gpu_peak

    assert gpu_peak(torch.device("cpu")) == {}  # no key on CPU: a 0 would read as a measurement
    mark = {"peak": 7e9, "num_alloc_retries": 4}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: mark.update(peak=1e9))
    monkeypatch.setattr(
        torch.cuda, "reset_accumulated_memory_stats", lambda d: mark.update(num_alloc_retries=0)
    )
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: mark["peak"])
    monkeypatch.setattr(
        torch.cuda, "memory_stats", lambda device: {"num_alloc_retries": mark["num_alloc_retries"]}
    )
    cuda = torch.device("cuda", 0)
    assert gpu_peak(cuda) == {"gpu_peak_gb": 7.0, "gpu_alloc_retries": 4.0}
    track_gpu_peak(cuda)  # a new step: a new high-water mark and a new count of retries
    assert gpu_peak(cuda) == {"gpu_peak_gb": 1.0, "gpu_alloc_retries": 0.0}


def test_the_step_metric_sums_are_read_in_order_in_one_transfer():
    """The loss metrics stay device tensors through a step's micro-batches (no sync before each backward);
    `read_once` turns the mix of them and plain floats into floats, in order."""
    import torch

    from learner.update import read_once

    values = [2.0, torch.tensor(0.25), 3, torch.tensor(1.5, dtype=torch.float64), torch.tensor([4.0])]
    assert read_once(values) == [2.0, 0.25, 3.0, 1.5, 4.0]
    assert read_once([1, 2.5]) == [1.0, 2.5]
