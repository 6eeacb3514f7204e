"""Shared pytest fixtures: each lives in its own plugin module under tests/fixtures/."""

pytest_plugins = [
    "tests.fixtures.services",
    "tests.fixtures.models",
    "tests.fixtures.trackers",
]
