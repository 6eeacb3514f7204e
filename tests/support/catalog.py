"""The metric catalogue of Parallax, read from docs/metrics.md, and PromQL name extraction.

`load_catalog()` parses the tables of docs/metrics.md into `MetricSpec`s (name, type, labels, owning
process, optional or not). `promql_metric_names(expr)` returns the metric names a PromQL
expression selects, and `unknown_series(expr, catalog)` those that the catalogue does not
define, so that dashboards, rules and tests can be checked against the one list every process
exports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

METRICS_MD = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
TYPES = ("counter", "gauge", "histogram")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")

_ROW = re.compile(
    r"^\|\s*`(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)`\s*\|\s*(?P<type>\w+)\s*\|\s*(?P<labels>[^|]*)\|(?P<meaning>.*)\|\s*$"
)
_SECTION = re.compile(r"^##\s+(?P<title>\S+)")

# PromQL words that look like identifiers but are not metric names.
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
    "limitk",
    "limit_ratio",
    "atan2",
    "start",
    "end",
}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_OFFSET = re.compile(r"\boffset\s+-?[0-9a-z]+")
_IDENT = re.compile(r"(?<![\w:.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:]|\s*\()")


@dataclass(frozen=True)
class MetricSpec:
    """One series family of docs/metrics.md."""

    name: str
    """Exported name (counters with their `_total`)."""
    type: str
    """counter, gauge or histogram."""
    labels: tuple[str, ...]
    """Label names the process sets (Prometheus adds job and instance)."""
    section: str
    """First word of the docs/metrics.md section: Generator, Reward, Learner, Broker, External."""
    optional: bool
    """True when a process may leave it out."""
    buckets: tuple[float, ...] = ()
    """Histogram bucket upper bounds (without +Inf) that every exporter must use."""
    lazy: bool = False
    """True when the series appears only with its first value (label values unknown before)."""

    def series(self) -> tuple[str, ...]:
        """Names as they appear on /metrics (histograms: bucket, sum and count)."""
        if self.type == "histogram":
            return tuple(self.name + s for s in HISTOGRAM_SUFFIXES)
        return (self.name,)


def load_catalog(path: Path = METRICS_MD) -> dict[str, MetricSpec]:
    """Every metric row of docs/metrics.md by name; a bad type or a duplicate name is an error."""
    catalog: dict[str, MetricSpec] = {}
    section = ""
    for line in Path(path).read_text().splitlines():
        heading = _SECTION.match(line)
        if heading:
            section = heading["title"]
            continue
        row = _ROW.match(line)
        if not row:
            continue
        name, mtype = row["name"], row["type"].strip()
        if mtype not in TYPES:
            raise ValueError(f"{path}: {name} has type {mtype!r}, expected one of {TYPES}")
        if name in catalog:
            raise ValueError(f"{path}: {name} is listed twice")
        labels = tuple(x.strip() for x in row["labels"].split(",") if x.strip() not in ("", "-"))
        buckets = _buckets(row["meaning"])
        if (mtype == "histogram") != bool(buckets):
            raise ValueError(f"{path}: {name}: histograms, and only histograms, list their buckets")
        meaning = row["meaning"]
        catalog[name] = MetricSpec(
            name, mtype, labels, section, "*(optional)*" in meaning, buckets, "*(once observed)*" in meaning
        )
    return catalog


def exported_series(catalog: dict[str, MetricSpec]) -> dict[str, MetricSpec]:
    """Map every series name (histogram parts included) to its spec."""
    return {series: spec for spec in catalog.values() for series in spec.series()}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names selected by a PromQL expression (functions, keywords and labels excluded)."""
    text = _STRING.sub(" ", expr)
    while _MATCHERS.search(text):
        text = _MATCHERS.sub(" ", text)
    text = _RANGES.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _OFFSET.sub(" ", text)
    return {m for m in _IDENT.findall(text) if m.lower() not in _KEYWORDS and not _is_number(m)}


def unknown_series(expr: str, catalog: dict[str, MetricSpec], extra: set[str] = frozenset()) -> set[str]:
    """Names in `expr` that neither the catalogue nor `extra` (e.g. recording rules) define."""
    known = set(exported_series(catalog)) | set(extra)
    return promql_metric_names(expr) - known


def _buckets(meaning: str) -> tuple[float, ...]:
    m = re.search(r"buckets\s+([-0-9., ]+)", meaning)
    if not m:
        return ()
    bounds = tuple(float(x) for x in m.group(1).replace(" ", "").strip(",").split(","))
    if list(bounds) != sorted(set(bounds)):
        raise ValueError(f"buckets must increase: {bounds}")
    if bounds[0] < 0:
        raise ValueError(f"negative bucket bounds make prometheus-client drop _sum: {bounds}")
    return bounds


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True
