"""deploy/grafana/render.py: every panel's queries are asked of Prometheus over the window, and drawn."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "render.py"


@pytest.fixture(scope="module")
def render():
    spec = importlib.util.spec_from_file_location("parallax_grafana_render", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_legend_and_units(render):
    assert render.legend("scored {{data_source}}", {"data_source": "synthetic"}) == "scored synthetic"
    assert render.legend("", {"job": "learner"}) == "{'job': 'learner'}"
    assert render.formatted(0.968, "percentunit") == "97%" and render.formatted(float("nan"), None) == "-"


def test_every_query_of_the_dashboard_is_asked_and_the_png_written(render, tmp_path, monkeypatch):
    asked = []

    def fake(url, expr, start, end, step):
        asked.append(expr)
        assert end - start == pytest.approx(600)
        return [{"metric": {"job": "learner"}, "values": [[start, "0.2"], [end, "0.9"]]}]

    monkeypatch.setattr(render, "query_range", fake)
    out = render.render("http://127.0.0.1:1", tmp_path / "d.png", minutes=10)
    board = json.loads(render.DASHBOARD.read_text())
    wanted = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert asked == wanted and out.stat().st_size > 10_000
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
