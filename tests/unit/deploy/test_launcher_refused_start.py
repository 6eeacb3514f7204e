"""A run the pre-flight checks refuse leaves no misleading artefacts and says where its run directory is."""

import dataclasses
import json

import pytest

from deploy.plan import LaunchConfig


@pytest.mark.parametrize("progress", ["off", "plain"])
def test_a_missing_model_leaves_no_plot_or_summary_and_names_the_run_dir(tmp_path, capsys, progress):
    from deploy.launcher import Launcher

    run_dir = tmp_path / "run"
    cfg = LaunchConfig(run_dir=str(run_dir), model=str(tmp_path / "nonexistent"), progress=progress)
    cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, task="geometry3k"))  # chance: NaN
    assert Launcher(cfg).run() == 2
    out = capsys.readouterr()
    said = out.out + out.err
    assert "cannot start:" in said and "nonexistent" in said and f"(run dir {run_dir})" in said
    assert "None" not in said
    assert not (run_dir / "curve.png").exists() and not (run_dir / "summary.json").exists()
    text = (run_dir / "events.jsonl").read_text()
    events = [
        json.loads(x, parse_constant=lambda c: pytest.fail(f"{c} in events.jsonl")) for x in text.splitlines()
    ]
    assert [e["event"] for e in events][-3:] == ["error", "stopping", "stopped"]
    assert "chance" not in events[0]  # geometry3k has no chance level: left out rather than NaN
