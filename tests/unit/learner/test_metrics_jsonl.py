"""learner/metrics.jsonl parses under a strict JSON parser: a NaN value is left out of its line."""

import json

import pytest
from prometheus_client import CollectorRegistry

from learner.metrics import LearnerMetrics


def test_a_nan_value_is_left_out_of_the_line(tmp_path):
    metrics = LearnerMetrics(CollectorRegistry(), tmp_path)
    metrics.log_step(
        {"step": 1, "reward_mean": 0.5, "mismatch_kl_fresh": float("nan"), "grad_norm": float("inf")}
    )
    metrics.log_step({"step": 2, "reward_mean": 0.25, "mismatch_kl_fresh": 0.01})
    text = (tmp_path / "metrics.jsonl").read_text()
    lines = [
        json.loads(x, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl"))
        for x in text.splitlines()
    ]
    assert [x["step"] for x in lines] == [1.0, 2.0]
    assert "mismatch_kl_fresh" not in lines[0] and "grad_norm" not in lines[0]
    assert lines[1]["mismatch_kl_fresh"] == 0.01
    assert metrics.gauges["grad_norm"]._value.get() == float("inf")  # the gauge still shows it
