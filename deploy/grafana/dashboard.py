"""The Grafana dashboard of Parallax, defined in Python and written as provisioning JSON.

    python deploy/grafana/dashboard.py            # (re)writes deploy/grafana/dashboards/parallax.json
    python deploy/grafana/dashboard.py --check    # exits 1 when the committed JSON is out of date

A maintainer's script (standard library only), run after editing the panels here, never the JSON. The
queries use only the series listed in docs/metrics.md and the datasource provisioned in
deploy/grafana/provisioning/datasources/prometheus.yml (uid `parallax-prometheus`);
tests/unit/deploy/test_deploy_dashboard.py checks both, and that the committed JSON is current.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATASOURCE_UID = "parallax-prometheus"
DASHBOARD_UID = "parallax-overview"
DASHBOARD_PATH = Path(__file__).resolve().parent / "dashboards" / "parallax.json"

DS = {"type": "prometheus", "uid": DATASOURCE_UID}
RI = "$__rate_interval"


def q(expr: str, legend: str) -> tuple[str, str]:
    """One query of a panel: PromQL and its legend format."""
    return expr, legend


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    """p50 and p99 of a histogram, aggregated over every process that exports it."""
    group = f"le{', ' + by if by else ''}"
    prefix = f"{{{{{by}}}}} " if by else ""
    return [
        q(
            f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket[{RI}])))",
            f"{prefix}p{int(p * 100)}",
        )
        for p in (0.5, 0.99)
    ]


def rows() -> list[tuple[str, list[dict]]]:
    """The dashboard's rows, each a title and its panels (before layout)."""
    return [
        (
            "Progress",
            [
                stat("Learner step", [q("max(parallax_learner_step)", "step")]),
                stat("Policy version", [q("max(parallax_learner_version)", "learner")]),
                stat(
                    "Generator version lag",
                    [q("max(parallax_learner_version) - min(parallax_generator_served_version)", "lag")],
                ),
                stat(
                    "Held-out accuracy",
                    [q("parallax_learner_eval_accuracy", "{{data_source}}")],
                    "percentunit",
                ),
                stat("Targets up", [q("sum by (job) (up)", "{{job}}")]),
                stat("MFU", [q("max(parallax_learner_mfu)", "MFU")], "percentunit"),
            ],
        ),
        (
            "Throughput",
            [
                graph(
                    "Tokens/s",
                    [
                        q(f"sum(rate(parallax_generator_tokens_total[{RI}]))", "generated"),
                        q(f"sum(rate(parallax_learner_tokens_total[{RI}]))", "trained"),
                    ],
                    "short",
                ),
                graph(
                    "Groups and samples/s",
                    [
                        q(f"sum(rate(parallax_generator_groups_total[{RI}]))", "groups generated"),
                        q(
                            f"sum by (data_source) (rate(parallax_reward_samples_total[{RI}]))",
                            "scored {{data_source}}",
                        ),
                    ],
                    "short",
                ),
            ],
        ),
        (
            "Reward and accuracy",
            [
                graph(
                    "Reward",
                    [
                        q("parallax_learner_reward_mean", "learner step mean"),
                        q(
                            f"sum by (data_source) (rate(parallax_reward_value_sum[{RI}]))"
                            f" / sum by (data_source) (rate(parallax_reward_value_count[{RI}]))",
                            "scored {{data_source}}",
                        ),
                    ],
                    "short",
                ),
                graph(
                    "Accuracy",
                    [
                        q("parallax_learner_accuracy", "train (learner step)"),
                        q("parallax_learner_eval_accuracy", "held-out {{data_source}}"),
                        q(
                            f"sum by (data_source) (rate(parallax_reward_accuracy_total[{RI}]))"
                            f" / sum by (data_source) (rate(parallax_reward_samples_total[{RI}]))",
                            "scored {{data_source}}",
                        ),
                    ],
                    "percentunit",
                ),
            ],
        ),
        (
            "Staleness and off-policy correction",
            [
                graph("Sample staleness (versions)", quantiles("parallax_learner_staleness"), "short"),
                graph("Behaviour vs learner mismatch KL", [q("parallax_learner_mismatch_kl", "KL")], "short"),
                graph(
                    "Clipped and masked tokens",
                    [
                        q("parallax_learner_clip_fraction", "clipped"),
                        q("parallax_learner_masked_fraction", "masked"),
                    ],
                    "percentunit",
                ),
                graph(
                    "Entropy and gradient norm",
                    [
                        q("parallax_learner_entropy", "entropy"),
                        q("parallax_learner_grad_norm", "grad norm"),
                    ],
                    "short",
                ),
            ],
        ),
        (
            "Weight sync",
            [
                graph("Learner weight sync", quantiles("parallax_learner_weight_sync_seconds"), "s"),
                graph("Generator weight load", quantiles("parallax_generator_weight_load_seconds"), "s"),
                graph(
                    "Time blocked by the staleness gate",
                    [q(f"rate(parallax_generator_staleness_blocked_seconds_total[{RI}])", "{{instance}}")],
                    "percentunit",
                ),
            ],
        ),
        (
            "Queues and broker",
            [
                graph(
                    "Generator queue depth", [q("parallax_generator_queue_depth", "{{instance}}")], "short"
                ),
                graph(
                    "Stream backlog",
                    [
                        q("max by (stream) (parallax_broker_stream_backlog)", "{{stream}} backlog"),
                        q("max by (stream) (redis_stream_length)", "{{stream}} length (redis)"),
                        q(
                            "max by (stream, group) (redis_stream_group_messages_pending)",
                            "{{stream}} {{group}} pending",
                        ),
                    ],
                    "short",
                ),
                graph(
                    "Rejected messages/s",
                    [
                        q(
                            f"sum by (stream, reason) (rate(parallax_broker_rejected_total[{RI}]))",
                            "{{stream}} {{reason}}",
                        )
                    ],
                    "short",
                ),
                graph(
                    "Reward grading latency",
                    [
                        *quantiles("parallax_reward_latency_seconds"),
                        q(f"sum(rate(parallax_reward_timeouts_total[{RI}]))", "timeouts/s"),
                    ],
                    "s",
                ),
            ],
        ),
    ]


def targets(queries: list[tuple[str, str]]) -> list[dict]:
    return [
        {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend, "range": True}
        for i, (expr, legend) in enumerate(queries)
    ]


def graph(title: str, queries: list[tuple[str, str]], unit: str) -> dict:
    """A time-series panel."""
    return {
        "type": "timeseries",
        "title": title,
        "datasource": DS,
        "fieldConfig": {
            "defaults": {"unit": unit, "custom": {"lineWidth": 1, "fillOpacity": 5}},
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": targets(queries),
    }


def stat(title: str, queries: list[tuple[str, str]], unit: str = "short") -> dict:
    """A single-value panel showing the latest value."""
    return {
        "type": "stat",
        "title": title,
        "datasource": DS,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "value",
            "graphMode": "area",
            "textMode": "auto",
        },
        "targets": targets(queries),
    }


def layout(sections: list[tuple[str, list[dict]]]) -> list[dict]:
    """Place rows and panels on Grafana's 24-column grid; stats are short, graphs tall."""
    panels, y, next_id = [], 0, 1
    for title, members in sections:
        panels.append(
            {
                "type": "row",
                "title": title,
                "id": next_id,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }
        )
        next_id, y = next_id + 1, y + 1
        width = max(4, 24 // len(members))
        height = 4 if all(p["type"] == "stat" for p in members) else 8
        x = 0
        for panel in members:
            if x + width > 24:
                x, y = 0, y + height
            panels.append({**panel, "id": next_id, "gridPos": {"h": height, "w": width, "x": x, "y": y}})
            next_id, x = next_id + 1, x + width
        y += height
    return panels


def build() -> dict:
    """The whole dashboard as Grafana's JSON model (provisioned, so read-only in the UI)."""
    return {
        "uid": DASHBOARD_UID,
        "title": "Parallax",
        "description": "Asynchronous GRPO: throughput, reward, accuracy, staleness, weight sync, queues.",
        "tags": ["parallax"],
        "timezone": "",
        "editable": False,
        "graphTooltip": 1,
        "refresh": "5s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "templating": {"list": []},
        "links": [],
        "panels": layout(rows()),
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed JSON is out of date")
    parser.add_argument("--out", type=Path, default=DASHBOARD_PATH)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is out of date: run python deploy/grafana/dashboard.py", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
