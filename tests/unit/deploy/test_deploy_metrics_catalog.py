"""docs/metrics.md parses into a consistent catalogue, and PromQL name extraction is right."""

from __future__ import annotations

import pytest

from tests.support.catalog import load_catalog, promql_metric_names, unknown_series

# The metric names dashboards and alerts rely on; docs/metrics.md must define each of them.
REQUIRED = {
    "parallax_generator_tokens_total": ("counter", ()),
    "parallax_generator_groups_total": ("counter", ()),
    "parallax_generator_queue_depth": ("gauge", ()),
    "parallax_generator_served_version": ("gauge", ()),
    "parallax_generator_staleness_blocked_seconds_total": ("counter", ()),
    "parallax_generator_weight_load_seconds": ("histogram", ()),
    "parallax_reward_samples_total": ("counter", ("data_source",)),
    "parallax_reward_latency_seconds": ("histogram", ()),
    "parallax_reward_timeouts_total": ("counter", ()),
    "parallax_reward_value": ("histogram", ("data_source",)),
    "parallax_reward_accuracy_total": ("counter", ("data_source",)),
    "parallax_learner_step": ("gauge", ()),
    "parallax_learner_version": ("gauge", ()),
    "parallax_learner_tokens_total": ("counter", ()),
    "parallax_learner_reward_mean": ("gauge", ()),
    "parallax_learner_accuracy": ("gauge", ()),
    "parallax_learner_mismatch_kl": ("gauge", ()),
    "parallax_learner_clip_fraction": ("gauge", ()),
    "parallax_learner_masked_fraction": ("gauge", ()),
    "parallax_learner_staleness": ("histogram", ()),
    "parallax_learner_entropy": ("gauge", ()),
    "parallax_learner_grad_norm": ("gauge", ()),
    "parallax_learner_weight_sync_seconds": ("histogram", ()),
    "parallax_learner_mfu": ("gauge", ()),
    "parallax_learner_eval_accuracy": ("gauge", ("data_source",)),
    "parallax_broker_rejected_total": ("counter", ("stream", "reason")),
    "parallax_broker_stream_backlog": ("gauge", ("stream",)),
}


@pytest.fixture(scope="module")
def catalog():
    return load_catalog()


def test_catalog_defines_every_agreed_metric_with_its_type_and_labels(catalog):
    for name, (mtype, labels) in REQUIRED.items():
        assert name in catalog, f"{name} missing from docs/metrics.md"
        assert catalog[name].type == mtype, name
        assert catalog[name].labels == labels, name
        assert not catalog[name].optional, name


def test_catalog_names_follow_the_conventions(catalog):
    for spec in catalog.values():
        if spec.section == "External":
            continue
        role = spec.section.lower().split()[0]
        assert spec.name.startswith(f"parallax_{role}_"), f"{spec.name} is not under parallax_{role}_"
        assert spec.name.endswith("_total") == (spec.type == "counter"), (
            f"{spec.name}: counters and only counters end in _total"
        )
        assert not spec.name.endswith(("_ms", "_milliseconds")), spec.name
        assert not {"job", "instance", "le"} & set(spec.labels), spec.name


def test_catalog_rejects_a_bad_type_and_a_duplicate(tmp_path):
    bad = tmp_path / "M.md"
    bad.write_text(
        "## Generator\n| metric | type | labels | meaning |\n|---|---|---|---|\n"
        "| `parallax_generator_x` | summary | - | x |\n"
    )
    with pytest.raises(ValueError, match="summary"):
        load_catalog(bad)
    bad.write_text(
        "## Generator\n| `parallax_generator_x` | gauge | - | x |\n"
        "| `parallax_generator_x` | gauge | - | y |\n"
    )
    with pytest.raises(ValueError, match="twice"):
        load_catalog(bad)


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("parallax_learner_step", {"parallax_learner_step"}),
        (
            'sum by (le) (rate(parallax_learner_staleness_bucket{job="learner"}[$__rate_interval]))',
            {"parallax_learner_staleness_bucket"},
        ),
        ("histogram_quantile(0.99, sum by (le, data_source) (rate(a_bucket[5m])))", {"a_bucket"}),
        ("max(x) - min(y) > 4", {"x", "y"}),
        ('up{job=~"learner|generator"} == 0', {"up"}),
        ("changes(s[15m]) == 0 and s > 0", {"s"}),
        ("sum(rate(t[5m])) / clamp_min(sum(rate(u[5m])), 1e-9) > 0.01", {"t", "u"}),
        ("a / on (instance) group_left (data_source) b offset 5m", {"a", "b"}),
        ("parallax:version_lag", {"parallax:version_lag"}),
    ],
)
def test_promql_metric_names(expr, names):
    assert promql_metric_names(expr) == names


def test_unknown_series_accepts_histogram_parts_and_counters_only_by_their_exported_name(catalog):
    assert (
        unknown_series("rate(parallax_reward_value_sum[1m]) / rate(parallax_reward_value_count[1m])", catalog)
        == set()
    )
    assert unknown_series("rate(parallax_generator_tokens[1m])", catalog) == {"parallax_generator_tokens"}
    assert unknown_series("parallax_learner_step_bucket", catalog) == {"parallax_learner_step_bucket"}
    assert unknown_series("parallax:x", catalog, extra={"parallax:x"}) == set()


def test_catalog_rejects_negative_bucket_bounds(tmp_path):
    """prometheus-client drops a histogram's _sum when a bound is negative (and the dashboard's means)."""
    bad = tmp_path / "M.md"
    bad.write_text("## Reward\n| `parallax_reward_x` | histogram | - | buckets -1, 0, 1 |\n")
    with pytest.raises(ValueError, match="negative"):
        load_catalog(bad)
    bad.write_text("## Reward\n| `parallax_reward_x` | histogram | - | no buckets given |\n")
    with pytest.raises(ValueError, match="buckets"):
        load_catalog(bad)
