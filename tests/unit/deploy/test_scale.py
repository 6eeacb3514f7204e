"""`python -m deploy scale RUN_DIR --generators N` and the launcher's side of it (deploy/scale.py): the
request file, generators started and stopped (SIGTERM, then handed back and reaped), with stand-in
processes instead of vLLM generators."""

from __future__ import annotations

import json
import sys
import time

import pytest

from deploy.__main__ import main as deploy_main
from deploy.scale import REQUEST, Scaler, request, slot_name
from deploy.supervisor import Supervisor

DRAINS = (
    "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
    "pathlib.Path(sys.argv[1]).touch(); time.sleep(120)"
)
"""A generator that exits 0 on SIGTERM (once it touched its ready file)."""


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "generator.toml").write_text("")
    return tmp_path


class StandIns(Scaler):
    """A Scaler whose generators are stand-in processes and whose hand-back is recorded."""

    def __init__(self, sv, **kw):
        super().__init__(sv, sv.run_dir / "configs" / "generator.toml", generator_cfg=None, **kw)
        self.handed: list[str] = []

    def _start(self, i):
        name, _ = slot_name(i)
        ready = self.sv.run_dir / f"{name}.ready"
        return self.sv.roles.start(name, [sys.executable, "-c", DRAINS, str(ready)], restarts=1)

    def _hand_back(self, generator_id):
        self.handed.append(generator_id)
        return 0


def _events(run_dir, kind):
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def test_the_command_writes_the_request_and_refuses_what_is_not_a_run(run_dir, tmp_path_factory, capsys):
    assert deploy_main(["scale", str(run_dir), "--generators", "3"]) == 0
    assert json.loads((run_dir / REQUEST).read_text())["generators"] == 3
    assert "3 generators" in capsys.readouterr().out
    assert deploy_main(["scale", str(tmp_path_factory.mktemp("not-a-run")), "--generators", "2"]) == 2
    with pytest.raises(ValueError, match=">= 0"):
        request(run_dir, -1)


def test_the_launcher_starts_and_stops_generators_as_asked(run_dir):
    sv = Supervisor(run_dir, env={}, max_restarts=1)
    scaler = StandIns(sv)
    try:
        scaler.slots.append(scaler._start(0))  # the run's first generator
        request(run_dir, 3)
        scaler.poll()
        assert [c.name for c in sv.roles.children] == ["generator", "generator-1", "generator-2"]
        assert all(c.max_restarts == 1 for c in sv.roles.children)  # supervised like the first one
        assert set(json.loads((run_dir / "pids.json").read_text())) == {
            "generator",
            "generator-1",
            "generator-2",
        }
        scaler.poll()  # the same request again: nothing changes
        assert len(sv.roles.children) == 3
        while not all((run_dir / f"{c.name}.ready").exists() for c in sv.roles.children):
            time.sleep(0.05)  # their SIGTERM handlers are in place (and the next request gets a new mtime)
        request(run_dir, 1)
        scaler.poll()
        assert [c.name for c in sv.roles.children] == ["generator"]  # the newest ones stop first
        stopping = [child for child, _, _ in scaler.retiring]
        for child in stopping:
            assert child.popen.wait(timeout=30) == 0  # SIGTERM: it drained and exited by itself
        scaler.poll()
        assert sorted(scaler.handed) == ["gen-1", "gen-2"] and not scaler.retiring
        sv.check()  # their exits are no crash of the run
        assert [e["generators"] for e in _events(run_dir, "scale")] == [3, 1]
        assert {e["process"] for e in _events(run_dir, "scale-stopped")} == {"generator-1", "generator-2"}
    finally:
        scaler.close()
        sv.roles.stop(grace_s=1)


def test_on_gpus_the_request_is_ignored_with_a_notice(run_dir):
    sv = Supervisor(run_dir, env={}, max_restarts=1)
    scaler = StandIns(sv, on_gpus=True)
    request(run_dir, 2)
    scaler.poll()
    assert not sv.roles.children
    assert "ignored" in _events(run_dir, "notice")[0]["text"]
