"""The repository speaks to its users: no development history or workplace words in the tree.

Results name their date, commit and GPU; history lives in git. This test scans every tracked text
file for words that only make sense to the people who built the project (numbered work sessions,
machines that were "lent", local staging paths, device-call queues) and fails naming file and line.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Written so that this file does not match its own patterns (a number after "session" only as \d).
PATTERNS = [
    r"\bsessions? \d",  # a numbered work session, or a range of them
    r"\bsession-\d|_session\d",  # file names
    r"\blent\b",
    r"/tmp/si[t]e",
    r"\bdevice[_ ]queue",
    r"bench/queue[s]",
    r"wheel bundle",
    r"\bdevice calls?\b",
    r"\bhelpers? (session|agent)",
]
WORDS = re.compile("|".join(PATTERNS), re.IGNORECASE)
SKIP_SUFFIXES = {".png", ".jpg", ".gz", ".safetensors", ".parquet", ".whl"}


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / line for line in out.stdout.splitlines() if line]


def test_no_history_or_workplace_words():
    this = Path(__file__).resolve()
    hits = []
    for path in tracked_files():
        if path.resolve() == this or path.suffix in SKIP_SUFFIXES or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if WORDS.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "history or workplace words in the tree:\n" + "\n".join(hits[:50])


def test_the_patterns_catch_what_they_are_for():
    for line in (
        "measured in session " + "40",
        "sessions " + "32-37",
        "on the " + "lent" + " H200",
        "PYTHONPATH=/tmp/" + "site",
        "see bench/" + "queues/h100.txt",
        "e2e_7b_h100_" + "session40.json",
    ):
        assert WORDS.search(line), line
    for line in ("a weight-sync session id", "equivalent", "silent", "the redis session"):
        assert not WORDS.search(line), line
