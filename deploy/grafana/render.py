"""The Grafana dashboard drawn without Grafana: each panel's PromQL from dashboards/parallax.json, queried
from a running Prometheus, plotted with matplotlib in the dashboard's own grid.

    python deploy/grafana/render.py --prometheus http://127.0.0.1:9090 --out dashboard.png [--minutes 30]

Time series panels plot their queries over the window (`$__rate_interval` becomes RATE_INTERVAL); stat
panels show each query's last value. Used where no Grafana build can be installed (it has no Debian
package, and PyPI and npm carry none of its server): docs/compose.md shows the CPU demo's run drawn so.
Standard library and matplotlib only.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent / "dashboards" / "parallax.json"
RATE_INTERVAL = "30s"  # Grafana's $__rate_interval at a 5 s scrape interval and a few-pixel step
GRID_COLUMNS = 24
MARGIN = 0.02  # of the figure's width, left of the grid (the tick labels of the first column)
MAX_LEGEND = 6  # a panel with more series leaves those that stayed at 0 out


def query_range(url: str, expr: str, start: float, end: float, step: float) -> list[dict]:
    params = {
        "query": expr.replace("$__rate_interval", RATE_INTERVAL),
        "start": start,
        "end": end,
        "step": step,
    }
    with urllib.request.urlopen(
        f"{url}/api/v1/query_range?{urllib.parse.urlencode(params)}", timeout=30
    ) as r:
        body = json.load(r)
    return body["data"]["result"] if body.get("status") == "success" else []


def legend(template: str, labels: dict[str, str]) -> str:
    """Grafana's legendFormat: {{label}} replaced by the series' label value."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template or "") or str(labels)


def formatted(value: float, unit: str | None) -> str:
    if math.isnan(value):
        return "-"
    if unit == "percentunit":
        return f"{100 * value:.0f}%"
    if unit == "s":
        return f"{value:.2f} s"
    return f"{value:.4g}"


def series_of(url: str, panel: dict, start: float, end: float, step: float) -> list[tuple[str, list, list]]:
    """(legend, times in minutes from start, values) of every series of the panel's queries."""
    found = []
    for target in panel.get("targets", []):
        for result in query_range(url, target["expr"], start, end, step):
            points = [(float(t), float(v)) for t, v in result["values"]]
            times = [(t - start) / 60 for t, _ in points]
            found.append(
                (legend(target.get("legendFormat", ""), result["metric"]), times, [v for _, v in points])
            )
    return found


def draw_panel(fig, panel: dict, rows: int, series: list) -> None:
    """One panel at its gridPos (24 columns; `rows` grid rows in all, the first one for the title)."""
    g = panel["gridPos"]
    left, width = MARGIN + g["x"] / GRID_COLUMNS * (1 - MARGIN), g["w"] / GRID_COLUMNS * (1 - MARGIN)
    bottom, height = 1 - (g["y"] + 1 + g["h"]) / rows, g["h"] / rows
    ax = fig.add_axes((left + 0.02, bottom + 0.16 * height, width - 0.045, 0.72 * height))
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    ax.set_title(panel["title"], fontsize=9, loc="left")
    ax.tick_params(labelsize=7)
    if panel["type"] == "stat":
        ax.axis("off")
        text = "\n".join(
            f"{name}: {formatted(values[-1], unit)}" if len(series) > 1 else formatted(values[-1], unit)
            for name, _, values in series
        )
        size = 18 if len(series) <= 1 else max(7, 12 - len(series))
        ax.text(0.5, 0.4, text or "no data", ha="center", va="center", fontsize=size, transform=ax.transAxes)
        return
    flat = [name for name, _, values in series if not any(values)]
    if len(series) > MAX_LEGEND and flat:  # many series at 0 (rejections by reason): one line says so
        series = [s for s in series if s[0] not in flat]
        ax.text(0.01, 0.02, f"{len(flat)} more series at 0", fontsize=6, transform=ax.transAxes)
    for name, times, values in series:
        ax.plot(times, values, label=name, linewidth=1.2)
    if unit == "percentunit":
        ax.yaxis.set_major_formatter(lambda v, _: f"{100 * v:.0f}%")
    if series:
        ax.legend(fontsize=6, loc="upper left")
    elif not flat:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", fontsize=9, transform=ax.transAxes)
    ax.set_xlabel("minutes", fontsize=7)


def render(url: str, out: Path, minutes: float, dashboard: Path = DASHBOARD) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    board = json.loads(dashboard.read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in board["panels"])
    end = time.time()
    start = end - minutes * 60
    step = max(5.0, minutes * 60 / 300)
    fig = plt.figure(figsize=(16, (rows + 1) * 0.32))
    title = (
        f"{board['title']}: dashboards/parallax.json over the last {minutes:g} minutes, drawn from Prometheus"
    )
    fig.text(0.5, 1 - 0.5 / (rows + 1), title, ha="center", va="center", fontsize=12)
    for panel in panels:
        draw_panel(fig, panel, rows + 1, series_of(url, panel, start, end, step))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python deploy/grafana/render.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus' URL")
    p.add_argument("--out", default="dashboard.png", help="the PNG to write")
    p.add_argument("--minutes", type=float, default=30.0, help="the window, ending now")
    args = p.parse_args(argv)
    print(render(args.prometheus.rstrip("/"), Path(args.out), args.minutes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
