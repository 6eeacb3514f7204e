"""runtime.jsonl: what a run writes as JSON parses under a strict parser (no NaN, no Infinity)."""

import json
import math

import pytest

from runtime.jsonl import dumps, finite


def strict(line: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as jq or JavaScript do."""
    return json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in {line}"))


def test_non_finite_values_are_left_out_of_objects_and_null_in_lists():
    value = {"a": 1.5, "b": math.nan, "c": {"d": math.inf, "e": "x"}, "f": [1.0, -math.inf], "g": 2}
    assert strict(dumps(value)) == {"a": 1.5, "c": {"e": "x"}, "f": [1.0, None], "g": 2}
    assert json.dumps(value).count("NaN") == 1  # what json alone writes


def test_finite_keeps_everything_else_as_it_is():
    value = {"step": 3, "ok": True, "name": "n", "none": None, "pair": (1, 2)}
    assert finite(value) == {"step": 3, "ok": True, "name": "n", "none": None, "pair": [1, 2]}
    assert strict(dumps(value, indent=2))["pair"] == [1, 2]
