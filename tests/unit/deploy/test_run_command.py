"""./run: its help, its refusals, and its message where the apt packages cannot be installed (nothing is
installed by these tests: each command stops before the install)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
COMMANDS = ["setup", "demo", "test", "bench", "test-gpu-stack", "help"]


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    bash = shutil.which("bash")
    return subprocess.run(
        [bash, str(ROOT / "run"), *args], capture_output=True, text=True, env=env, timeout=60
    )


def test_help_lists_every_command_on_one_line_and_exits_0():
    done = run("help")
    assert done.returncode == 0 and done.stderr == ""
    lines = done.stdout.splitlines()
    for command in COMMANDS:
        described = [line for line in lines if line.split()[:1] == [command]]
        assert len(described) == 1, f"{command}: {described}"
        assert len(described[0].split()) > 2, f"{command} has no description"
    assert "PARALLAX_TORCH_INDEX" in done.stdout and "source .venv/bin/activate" in done.stdout


def test_an_unknown_or_missing_command_prints_the_help_on_stderr_and_exits_2():
    help_text = run("help").stdout
    for args in (["no-such-command"], []):
        done = run(*args)
        assert done.returncode == 2 and done.stdout == "" and done.stderr == help_text


def test_bench_without_a_name_is_refused_before_installing_anything():
    done = run("bench")
    assert done.returncode == 1 and "bench needs a NAME" in done.stderr


def test_without_root_or_sudo_it_names_the_packages_to_install_by_hand(tmp_path):
    """A user that is not root, on a machine without sudo, redis-server, prometheus or python3."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "id").write_text("#!/bin/sh\necho 1000\n")
    (stubs / "id").chmod(0o755)
    (stubs / "dirname").symlink_to(shutil.which("dirname"))
    done = run("setup", env={"PATH": str(stubs), "HOME": str(tmp_path)})
    assert done.returncode == 1, done.stderr
    assert "redis-server" in done.stderr and "prometheus" in done.stderr and "as root" in done.stderr
    assert "apt-get install" in done.stderr and "sudo" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_the_ci_entry_point_sets_up_then_lints_then_tests():
    text = (ROOT / ".ci" / "run").read_text()
    steps = [line for line in text.splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert steps[0] == "./run setup" and steps[-1] == "exec ./run test"
    assert os.access(ROOT / "run", os.X_OK) and os.access(ROOT / ".ci" / "run", os.X_OK)
