"""Each role's metrics module registers exactly the series of docs/metrics.md, with its buckets.

A role whose `<package>/metrics.py` is not written yet is skipped. The Prometheus integration test
(tests/integration/test_prometheus_scrape.py) checks the same names on running processes.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
from prometheus_client import CollectorRegistry

from runtime.metrics import new_registry
from tests.support.catalog import load_catalog

ROLES = {"Reward": "reward_service", "Generator": "generator", "Learner": "learner"}
# Constructor arguments the metrics classes may need, by parameter name.
KNOWN_ARGS = {"registry": new_registry, "run_dir": lambda: None, "data_sources": lambda: ("geometry3k",)}


def role_registries(package: str) -> list[CollectorRegistry]:
    """Registries of every metrics class in `<package>.metrics` that builds from KNOWN_ARGS."""
    try:
        module = importlib.import_module(f"{package}.metrics")
    except ModuleNotFoundError as exc:
        if exc.name in (f"{package}.metrics", package):
            pytest.skip(f"{package}/metrics.py not written yet")
        raise
    found = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ != module.__name__:
            continue
        params = inspect.signature(cls).parameters
        kwargs = {name: value() for name, value in KNOWN_ARGS.items() if name in params}
        if any(
            p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            for n, p in params.items()
            if n not in kwargs
        ):
            continue
        registry = getattr(cls(**kwargs), "registry", None)
        if isinstance(registry, CollectorRegistry):
            found.append(registry)
    if not found:
        pytest.skip(f"{package}.metrics has no class that builds a registry from {sorted(KNOWN_ARGS)}")
    return found


def families(registries: list[CollectorRegistry]) -> dict[str, tuple[str, set[str], set[float]]]:
    """exported name -> (type, label names, histogram bounds) for every parallax_ family."""
    out = {}
    for registry in registries:
        for fam in registry.collect():
            if not fam.name.startswith("parallax_"):
                continue
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            labels = {k for s in fam.samples for k in s.labels if k != "le"}
            bounds = {float(s.labels["le"]) for s in fam.samples if "le" in s.labels} - {float("inf")}
            out[name] = (fam.type, labels, bounds)
    return out


@pytest.mark.parametrize("section", sorted(ROLES))
def test_role_registers_the_catalogued_series(section):
    catalog = load_catalog()
    exported = families(role_registries(ROLES[section]))
    for name, (mtype, labels, bounds) in exported.items():
        assert name in catalog, f"{name} is exported but not in docs/metrics.md"
        spec = catalog[name]
        assert spec.type == mtype, f"{name}: {mtype}, docs/metrics.md says {spec.type}"
        if labels:
            assert labels == set(spec.labels), (
                f"{name}: labels {sorted(labels)}, docs/metrics.md says {spec.labels}"
            )
        if bounds:
            assert bounds == set(spec.buckets), f"{name}: buckets differ from docs/metrics.md"
    required = {n for n, s in catalog.items() if s.section == section and not s.optional}
    assert required - set(exported) == set(), f"{ROLES[section]} does not register these"
