"""deploy/prometheus: promtool accepts the config and the rules, and the rules' unit tests pass."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.catalog import load_catalog, unknown_series

PROM = Path(__file__).resolve().parents[3] / "deploy" / "prometheus"

promtool = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed"
)


def run_promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=cwd, timeout=60)


@promtool
def test_promtool_accepts_the_config_and_loads_the_rules():
    out = run_promtool("check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rules found" in out.stdout + out.stderr, "the rule files were not loaded"


@promtool
def test_promtool_rejects_a_broken_config(tmp_path):
    """The check can fail: a scrape job without a name is refused."""
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    cfg["scrape_configs"].append({"static_configs": [{"targets": ["x:1"]}]})
    cfg["rule_files"] = []
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    out = run_promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert out.returncode != 0


@promtool
def test_rule_unit_tests_pass():
    out = run_promtool("test", "rules", "rules_test.yml", cwd=PROM / "tests")
    assert out.returncode == 0, out.stdout + out.stderr


def rules() -> list[dict]:
    found = []
    for path in sorted((PROM / "rules").glob("*.yml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            found.extend(group["rules"])
    return found


def test_rules_query_only_catalogued_series():
    catalog = load_catalog()
    recorded = {r["record"] for r in rules() if "record" in r}
    for rule in rules():
        assert unknown_series(rule["expr"], catalog, extra=recorded) == set(), (
            rule.get("record") or rule["alert"]
        )


def test_every_alert_is_exercised_by_a_rule_unit_test():
    tests = yaml.safe_load((PROM / "tests" / "rules_test.yml").read_text())["tests"]
    tested = {a["alertname"] for t in tests for a in t.get("alert_rule_test", []) if a.get("exp_alerts")}
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts - tested == set()
