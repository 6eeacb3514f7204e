"""Reward registry: routing by data source, configured overrides, and the synthetic reward."""

from __future__ import annotations

import pytest

from reward_service.config import RewardConfig
from reward_service.rewards import REWARDS, UnknownReward, load, load_format, route, synthetic
from tasks.synthetic import verify

T = "<think>look</think>"


def test_routes_pick_a_reward_per_data_source():
    assert route("geometry3k") == "math"
    assert route("synthetic") == "synthetic"
    assert route("something-new") == "math"
    assert route("something-new", default="synthetic") == "synthetic"
    assert route("geometry3k", {"geometry3k": "synthetic"}) == "synthetic"
    with pytest.raises(UnknownReward):
        route("x", {"x": "no-such-reward"})


def test_every_registered_reward_loads_with_a_format_part():
    for name in REWARDS:
        parts = load(name)(T + " \\boxed{4}", "4")
        assert (parts.accuracy, parts.format) == (1.0, 1.0)
        assert load_format(name)("\\boxed{4}") == 0.0


@pytest.mark.parametrize(
    "response, truth",
    [
        (T + " \\boxed{Red}", "red"),
        (T + " \\boxed{\\text{blue}}", "blue"),
        (T + " \\boxed{three}", "3"),
        (T + " \\boxed{left} \\boxed{right}", "left"),
        ("no box", "red"),
        (T + " \\boxed{2}", "3"),
    ],
)
def test_synthetic_reward_is_the_tasks_verifier(response, truth):
    assert synthetic.compute(response, truth).accuracy == float(verify(response, truth))


def test_config_rejects_unknown_rewards_and_unsafe_budgets():
    from broker.config import BrokerConfig

    with pytest.raises(ValueError, match="unknown reward"):
        RewardConfig(routes={"geometry3k": "nope"}).validate()
    with pytest.raises(ValueError, match="claim_idle_s"):
        RewardConfig(groups_per_read=4, group_budget_s=10, broker=BrokerConfig(claim_idle_s=30)).validate()
    assert RewardConfig().weights.combine(1, 1) == pytest.approx(1.0)


def test_shipped_toml_and_broker_flags_resolve(monkeypatch):
    from pathlib import Path

    from runtime.config import load_config

    monkeypatch.setenv("PARALLAX_BROKER_URL", "redis://:secret@example:6379/0")
    toml = Path(__file__).resolve().parents[3] / "deploy" / "configs" / "reward.toml"
    cfg = load_config(RewardConfig, ["--config", str(toml), "--broker.url", "redis://h:1/0"])
    assert cfg.broker.url == "redis://h:1/0" and cfg.workers == 4 and cfg.routes["synthetic"] == "synthetic"
    assert load_config(RewardConfig, ["--config", str(toml)]).broker.url == "redis://:secret@example:6379/0"
    with pytest.raises(SystemExit, match="unknown reward 'nope'"):
        load_config(RewardConfig, ["--config", str(toml), "--default-reward", "nope"])
