"""The reward worker end to end against a real broker (redis-server; ZeroMQ where noted).

Scoring through the streams, dead-lettering of garbage, publish-once on redelivery and on a
stale claim, reclaim of a killed worker's pending group, N workers under the supervisor, metrics.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request

import pytest

import broker
from broker.channel import Publisher, Subscriber
from broker.config import BrokerConfig
from broker.names import Names
from broker.redis_server import free_port
from broker.schemas import Rollout, RolloutGroup, ScoredGroup
from reward_service.config import RewardConfig
from reward_service.dedupe import OnceGate, scored_key
from reward_service.worker import RewardWorker
from runtime.metrics import MetricsConfig

T = "<think>a</think>"
CLIENT = "test-learner"


def make_group(group_id: str, answers: list[str], ground_truth: str, data_source: str = "geometry3k"):
    samples = [
        Rollout.of(
            token_ids=[1, 2],
            logprobs=[-0.1, -0.2],
            response_text=a,
            version_start=0,
            version_end=0,
            finish_reason="stop",
        )
        for a in answers
    ]
    return RolloutGroup(
        group_id=group_id,
        prompt_id=f"p-{group_id}",
        data_source=data_source,
        prompt_token_ids=[1, 2, 3],
        images=[],
        ground_truth=ground_truth,
        samples=samples,
    )


def config(
    url: str, names: Names, claim_idle_s: float = 5.0, metrics_port: int = 0, **overrides
) -> RewardConfig:
    base = dict(
        broker=BrokerConfig(url=url, namespace=names.namespace, claim_idle_s=claim_idle_s),
        metrics=MetricsConfig(port=metrics_port),
        burst=True,
        block_s=0.2,
        timeout_s=1.0,
        group_budget_s=2.0,
        spare_grader=False,
        groups_per_read=1,
    )
    return RewardConfig(**{**base, **overrides})


def publish(url: str, names: Names, groups: list[RolloutGroup]) -> None:
    with broker.connect(url) as transport:
        Publisher(transport, names.rollouts).publish_many(groups)


def scored(url: str, names: Names) -> list[ScoredGroup]:
    with broker.connect(url) as transport:
        sub = Subscriber(transport, names.scored, Names.LEARNER, CLIENT, expect=ScoredGroup)
        out, empty = [], 0
        while empty < 2:
            batch = sub.poll(count=100, block_s=0.2)
            empty = 0 if batch else empty + 1
            out += [msg for _, msg in batch]
        return out


def run_worker(cfg: RewardConfig, index: int = 0) -> RewardWorker:
    worker = RewardWorker(cfg, index)
    try:
        worker.run()
    finally:
        worker.close()
    return worker


def test_worker_scores_every_sample_and_publishes(broker_url, names):
    publish(
        broker_url,
        names,
        [
            make_group("g-geo", [T + "\\boxed{4}", "\\boxed{4}", T + "\\boxed{5}", "no box"], "4"),
            make_group("g-syn", [T + "\\boxed{ Red }", T + "\\boxed{blue}"], "red", data_source="synthetic"),
            make_group("g-other", [T + "\\boxed{\\frac{1}{2}}"], "0.5", data_source="unlisted-source"),
        ],
    )
    worker = run_worker(config(broker_url, names))
    assert worker.published == 3
    by_id = {s.group.group_id: s for s in scored(broker_url, names)}
    assert set(by_id) == {"g-geo", "g-syn", "g-other"}
    geo = by_id["g-geo"].scores
    assert [(s.accuracy, s.format) for s in geo] == [(1, 1), (1, 0), (0, 1), (0, 0)]
    assert [s.reward for s in geo] == pytest.approx([1.0, 0.9, 0.1, 0.0])
    assert [s.accuracy for s in by_id["g-syn"].scores] == [1.0, 0.0]
    assert by_id["g-other"].scores[0].reward == pytest.approx(1.0)
    assert "reward" in by_id["g-geo"].group.timings
    assert by_id["g-geo"].scorer_id == worker.consumer
    with broker.connect(broker_url) as transport:
        assert transport.pending(names.rollouts, Names.REWARD) == 0


def test_a_window_of_groups_in_the_grader_keeps_order_timeouts_and_publish_once(broker_url, names):
    hang = T + "\\boxed{9**9**9}"
    groups = [make_group(f"g{i}", [T + f"\\boxed{{{i}}}", T + "\\boxed{0}"], str(i)) for i in range(6)]
    groups[1] = make_group("g1", [T + "\\boxed{2\\sqrt{3}}", hang], "2\\sqrt{3}")  # sympy runs: it hangs
    publish(broker_url, names, groups)
    worker = run_worker(config(broker_url, names, groups_per_read=2))  # one group queued behind another
    assert worker.published == 6 and worker.duplicates == 0
    by_id = {s.group.group_id: s.scores for s in scored(broker_url, names)}
    assert sorted(by_id) == [f"g{i}" for i in range(6)]
    assert all(scores[0].accuracy == 1.0 and not scores[0].timed_out for scores in by_id.values())
    assert by_id["g1"][1].timed_out and not any(by_id[g][1].timed_out for g in by_id if g != "g1")
    assert by_id["g0"][1].accuracy == 1.0 and by_id["g2"][1].accuracy == 0.0
    with broker.connect(broker_url) as transport:
        assert transport.pending(names.rollouts, Names.REWARD) == 0


def test_weights_and_routes_are_configurable_and_publishing_inline_works(redis_server, names):
    publish(redis_server.url, names, [make_group("g1", ["\\boxed{red}"], "red", data_source="colours")])
    run_worker(
        config(
            redis_server.url,
            names,
            accuracy_weight=1.0,
            format_weight=0.5,
            routes={"colours": "synthetic"},
            publish_thread=False,
        )
    )
    [group] = scored(redis_server.url, names)
    assert (group.scores[0].accuracy, group.scores[0].reward) == (1.0, 1.0)


def test_garbage_is_dead_lettered_and_good_groups_survive(redis_server, names):
    good = [make_group(f"g{i}", [T + "\\boxed{1}"], "1") for i in range(2)]
    with broker.connect(redis_server.url) as transport:
        pub = Publisher(transport, names.rollouts)
        pub.publish(good[0])
        transport.publish(names.rollouts, b"\x93not a message")
        pub.publish(good[1])
    worker = run_worker(config(redis_server.url, names))
    assert worker.published == 2
    assert {s.group.group_id for s in scored(redis_server.url, names)} == {"g0", "g1"}
    with broker.connect(redis_server.url) as transport:
        [dead] = transport.dead_letters(names.rollouts)
        assert dead.payload == b"\x93not a message"


def test_a_forged_rollout_group_is_dead_lettered_and_never_scored(redis_server, names, monkeypatch):
    monkeypatch.setenv("PARALLAX_BROKER_AUTH_KEY", "the run's key")  # the worker's BrokerConfig reads it
    with (
        broker.connect(redis_server.url, auth_key="the run's key") as run,
        broker.connect(redis_server.url) as attacker,
    ):
        Publisher(attacker, names.rollouts).publish(make_group("g-forged", [T + "\\boxed{1}"], "1"))
        Publisher(run, names.rollouts).publish(make_group("g-genuine", [T + "\\boxed{1}"], "1"))
    worker = run_worker(config(redis_server.url, names))
    assert worker.published == 1
    assert worker.subscriber.rejected_count("auth") == 1
    with broker.connect(redis_server.url, auth_key="the run's key") as transport:
        sub = Subscriber(transport, names.scored, Names.LEARNER, CLIENT, expect=ScoredGroup)
        assert [m.group.group_id for _, m in sub.poll(count=5, block_s=0.5)] == ["g-genuine"]
        [dead] = transport.dead_letters(names.rollouts)
        assert "authentication tag" in dead.reason


def test_a_redelivered_group_is_published_once(redis_server, names):
    group = make_group("g-dup", [T + "\\boxed{1}"], "1")
    publish(redis_server.url, names, [group, group])  # e.g. a generator that retried its publish
    first = run_worker(config(redis_server.url, names))
    assert (first.published, first.duplicates) == (1, 1)
    publish(redis_server.url, names, [group])
    second = run_worker(config(redis_server.url, names), index=1)
    assert (second.published, second.duplicates) == (0, 1)
    assert len(scored(redis_server.url, names)) == 1


def test_publish_once_survives_a_crash_between_publish_and_ack(redis_server, names):
    """Worker A published and marked the group done, then died before acking: B must only ack."""
    publish(redis_server.url, names, [make_group("g-crash", [T + "\\boxed{1}"], "1")])
    cfg = config(redis_server.url, names, claim_idle_s=0.5, group_budget_s=0.4, timeout_s=0.4)
    a = RewardWorker(cfg, index=0)
    [(delivery, group)] = a.subscriber.poll(count=1, block_s=1.0)
    assert a.outbox.gate.claim(group.group_id).value == "mine"
    a.outbox.publisher.publish(ScoredGroup(group=group, scores=a.scorer.score(group), scorer_id="A"))
    a.outbox.gate.finish(group.group_id)
    a.close()  # no ack: the entry stays pending on A
    time.sleep(0.6)
    b = run_worker(cfg, index=1)
    assert (b.published, b.duplicates) == (0, 1)
    assert [s.scorer_id for s in scored(redis_server.url, names)] == ["A"]


def test_stale_and_live_claims(redis_server, names):
    with broker.connect(redis_server.url) as transport:
        a = OnceGate(transport, names, "A", stale_s=60)
        b = OnceGate(transport, names, "B", stale_s=60)
        assert a.claim("g").value == "mine"
        assert b.claim("g").value == "busy"  # A is alive and publishing
        assert a.claim("g").value == "mine"  # A's own retry
        transport.set_value(scored_key(names, "g"), b"claim A 1.0")  # A claimed long ago, never finished
        assert b.claim("g").value == "mine"
        b.release("g")
        assert a.claim("g").value == "mine"
        a.finish("g")
        assert b.claim("g").value == "done" and b.is_done("g")


def test_a_killed_workers_pending_group_is_reclaimed(redis_server, names):
    """A worker hangs on a group, is SIGKILLed, and another worker reclaims and scores the group."""
    slow = make_group("g-slow", [T + "\\boxed{9**9**9}", T + "\\boxed{2\\sqrt{3}}"], "2\\sqrt{3}")
    publish(redis_server.url, names, [slow])
    victim = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reward_service",
            "--broker.url",
            redis_server.url,
            "--broker.namespace",
            names.namespace,
            "--metrics.port",
            "0",
            "--timeout-s",
            "100",
            "--group-budget-s",
            "150",
            "--broker.claim-idle-s",
            "300",
            "--groups-per-read",
            "1",
            "--no-spare-grader",
            "--consumer",
            "victim",
        ]
    )
    try:
        with broker.connect(redis_server.url) as transport:
            deadline = time.monotonic() + 60
            while transport.pending(names.rollouts, Names.REWARD) == 0:
                assert time.monotonic() < deadline and victim.poll() is None, "victim never took the group"
                time.sleep(0.1)
    finally:
        victim.kill()
        victim.wait()
    rescuer = run_worker(config(redis_server.url, names, claim_idle_s=3.0, group_budget_s=2.5, timeout_s=0.8))
    assert rescuer.published == 1
    [group] = scored(redis_server.url, names)
    assert [(s.timed_out, s.accuracy, s.format) for s in group.scores] == [
        (True, 0.0, 1.0),
        (False, 1.0, 1.0),
    ]
    with broker.connect(redis_server.url) as transport:
        assert transport.pending(names.rollouts, Names.REWARD) == 0


def test_supervisor_runs_n_workers_that_share_the_stream(redis_server, names):
    groups = [
        make_group(f"g{i:03d}", [T + f"\\boxed{{{i}}}", f"\\boxed{{{i + 1}}}"], str(i)) for i in range(40)
    ]
    publish(redis_server.url, names, groups)
    port = free_port()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "reward_service",
            "--workers",
            "2",
            "--burst",
            "--broker.url",
            redis_server.url,
            "--broker.namespace",
            names.namespace,
            "--metrics.port",
            str(port),
            "--timeout-s",
            "2",
            "--block-s",
            "0.2",
            "--no-spare-grader",
        ],
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = scored(redis_server.url, names)
    assert sorted(s.group.group_id for s in out) == [g.group_id for g in groups]
    assert all([x.accuracy for x in s.scores] == [1.0, 0.0] for s in out)
    assert len({s.scorer_id for s in out}) >= 1


def test_metrics_are_served_per_data_source(redis_server, names):
    publish(
        redis_server.url,
        names,
        [
            make_group("g1", [T + "\\boxed{4}", T + "\\boxed{5}"], "4"),
            make_group("g2", [T + "\\boxed{red}"], "red", data_source="synthetic"),
            make_group("g3", [T + "\\boxed{9**9**9}"], "2\\sqrt{3}"),
        ],
    )
    port = free_port()
    run_worker(config(redis_server.url, names, metrics_port=port - 2), index=2)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    series = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert series['parallax_reward_samples_total{data_source="geometry3k"}'] == 3
    assert series['parallax_reward_samples_total{data_source="synthetic"}'] == 1
    assert series['parallax_reward_accuracy_total{data_source="geometry3k"}'] == 1
    assert series["parallax_reward_timeouts_total"] == 1
    assert series['parallax_reward_value_count{data_source="geometry3k"}'] == 3
    assert series["parallax_reward_latency_seconds_count"] == 4
    assert series["parallax_reward_groups_total"] == 3
