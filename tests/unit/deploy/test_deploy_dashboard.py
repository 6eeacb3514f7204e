"""The Grafana provisioning: datasource, dashboard provider and the dashboard JSON that
deploy/grafana/dashboard.py writes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from tests.support.catalog import load_catalog, promql_metric_names, unknown_series
from tests.support.dashboard import DASHBOARD_SCRIPT, load_dashboard

GRAFANA = DASHBOARD_SCRIPT.parent
DEPLOY = GRAFANA.parent

# What the dashboard must show: each topic needs a panel querying one of these series.
TOPICS = {
    "throughput": {"parallax_generator_tokens_total", "parallax_learner_tokens_total"},
    "reward": {"parallax_learner_reward_mean", "parallax_reward_value_sum"},
    "accuracy": {"parallax_learner_eval_accuracy", "parallax_learner_accuracy"},
    "staleness": {"parallax_learner_staleness_bucket"},
    "weight sync": {"parallax_learner_weight_sync_seconds_bucket"},
    "mismatch KL": {"parallax_learner_mismatch_kl"},
    "queue depths": {
        "parallax_generator_queue_depth",
        "parallax_broker_stream_backlog",
        "redis_stream_length",
    },
}


@pytest.fixture(scope="module")
def board() -> dict:
    return json.loads((GRAFANA / "dashboards" / "parallax.json").read_text())


def panels(board: dict) -> list[dict]:
    return [p for p in board["panels"] if p["type"] != "row"]


def exprs(board: dict) -> list[str]:
    return [t["expr"] for p in panels(board) for t in p["targets"]]


def test_committed_json_is_what_the_builder_writes(board):
    dashboard = load_dashboard()
    assert board == dashboard.build(), "run: python deploy/grafana/dashboard.py"
    assert dashboard.main(["--check"]) == 0


def test_check_flags_a_stale_file(tmp_path):
    dashboard = load_dashboard()
    stale = tmp_path / "parallax.json"
    stale.write_text("{}\n")
    assert dashboard.main(["--check", "--out", str(stale)]) == 1
    assert dashboard.main(["--out", str(stale)]) == 0
    assert dashboard.main(["--check", "--out", str(stale)]) == 0


def test_the_script_runs_as_a_maintainer_runs_it(tmp_path):
    """`python deploy/grafana/dashboard.py` from any directory: writes the JSON, then --check passes."""
    out = tmp_path / "parallax.json"
    script = [sys.executable, str(DASHBOARD_SCRIPT), "--out", str(out)]
    written = subprocess.run(script, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert written.returncode == 0, written.stderr
    assert json.loads(out.read_text()) == json.loads((GRAFANA / "dashboards" / "parallax.json").read_text())
    checked = subprocess.run([*script, "--check"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr


def test_datasource_is_provisioned_with_the_uid_every_panel_uses(board):
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = provisioned["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://127.0.0.1:9090"  # host networking
    for panel in panels(board):
        assert panel["datasource"] == {"type": "prometheus", "uid": source["uid"]}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]


def test_dashboard_provider_points_at_the_mounted_dashboards():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "parallax.yml").read_text())
    (prov,) = provider["providers"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in compose["services"]["grafana"]["volumes"]}
    assert mounts[prov["options"]["path"]] == "./grafana/dashboards"
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"


def test_every_query_uses_only_catalogued_series(board):
    catalog = load_catalog()
    for expr in exprs(board):
        assert unknown_series(expr, catalog) == set(), expr


def test_dashboard_covers_every_topic(board):
    used = set().union(*(_names(e) for e in exprs(board)))
    for topic, series in TOPICS.items():
        assert used & series, f"no panel shows {topic}"


def test_panels_have_unique_ids_and_fit_the_grid(board):
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
    assert all(len({t["refId"] for t in p["targets"]}) == len(p["targets"]) for p in panels(board))


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed"
)
def test_every_query_is_valid_promql(board, tmp_path):
    """promtool parses each query as a recording rule (Grafana's $__rate_interval replaced by 1m)."""
    rules = [
        {"record": f"dashboard:q{i}", "expr": e.replace("$__rate_interval", "1m")}
        for i, e in enumerate(exprs(board))
    ]
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def _names(expr: str) -> set[str]:
    return promql_metric_names(expr)
