"""Every committed benchmark result says how to reproduce it and is on the results page: each file in
bench/results/ has a stable name (no dates, no machine in it), each JSON starts with its `date`, `commit`,
`gpu` and the exact `command`, and docs/benchmarks.md links every file; the writer bench/common.py
records those keys itself."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from bench import common

ROOT = Path(__file__).resolve().parents[3]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"


def test_every_result_is_linked_from_the_results_page():
    page = PAGE.read_text()
    for path in sorted(RESULTS.iterdir()):
        assert f"../bench/results/{path.name})" in page, f"docs/benchmarks.md does not link {path.name}"


def test_the_results_page_links_only_files_that_exist():
    for name in re.findall(r"\.\./bench/results/([^)#\s]+)\)", PAGE.read_text()):
        assert (RESULTS / name).exists(), f"docs/benchmarks.md links bench/results/{name}, which is gone"


@pytest.mark.parametrize("path", sorted(RESULTS.iterdir()), ids=lambda p: p.name)
def test_a_result_has_a_stable_name(path):
    assert path.suffix in (".json", ".png")
    assert re.fullmatch(r"[a-z0-9_]+\.(json|png)", path.name), path.name
    assert not re.search(r"session|20\d\d|h100|h200|round\d", path.name), f"{path.name}: a dated name"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_a_result_starts_with_its_provenance(path):
    data = json.loads(path.read_text())
    assert list(data)[:4] == ["date", "commit", "gpu", "command"]
    assert re.match(r"20\d\d-\d\d-\d\d", data["date"])
    assert re.fullmatch(r"[0-9a-f]{7,40}", data["commit"])
    assert data["gpu"].startswith(("NVIDIA ", "CPU: "))
    commands = data["command"] if isinstance(data["command"], list) else [data["command"]]
    assert commands and all(re.search(r"python3? -m |\./run |bash ", c) for c in commands)


def test_the_writer_records_the_provenance(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench/reward.py", "--groups", "5"])
    monkeypatch.setattr(common, "_module_name", lambda: "bench.reward")
    monkeypatch.setattr(common, "machine", lambda: {"cpus": 2, "platform": "test"})
    out = common.write_result({"rows": [1]}, tmp_path / "r.json")
    data = json.loads(out.read_text())
    assert list(data)[:5] == ["date", "commit", "gpu", "command", "machine"]
    assert data["command"] == "python -m bench.reward --groups 5" and data["rows"] == [1]
    assert data["gpu"].startswith("CPU: 2-core")
    assert bool(data["commit"]) == (ROOT / ".git").exists()


def test_default_result_files_are_the_stable_names():
    assert common.result_path("learner_step", "qwen3-vl-8b").name == "learner_step_qwen3_vl_8b.json"
    assert common.result_path("e2e", "7b", "1gpu").name == "e2e_7b_1gpu.json"
    assert common.result_path("generator", "/ckpt/My-3B", "").name == "generator_my_3b.json"
