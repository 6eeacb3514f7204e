"""Every committed benchmark result names the command that made it: each JSON in bench/results/ has a row
in bench/results/README.md (the session-19 profile was once committed without one), and the row or the
JSON itself holds the command (rows of older results say "in the file")."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[3] / "bench" / "results"


def _command_in(path: Path) -> bool:
    data = json.loads(path.read_text())
    return isinstance(data, dict) and bool(data.get("command") or data.get("config"))


def test_every_result_json_has_a_row_and_a_command():
    rows = [line for line in (RESULTS / "README.md").read_text().splitlines() if line.startswith("| ")]
    for path in sorted(RESULTS.glob("*.json")):
        row = next((r for r in rows if path.name in r), None)
        assert row is not None, f"bench/results/README.md has no row for {path.name}"
        assert "python" in row or "bash" in row or _command_in(path), (
            f"{path.name}: no command, here or there"
        )
