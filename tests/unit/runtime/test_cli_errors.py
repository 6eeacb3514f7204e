"""Command-line mistakes exit 1 with one line, as a TOML file's do; --help names `python -m <package>`."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest

from runtime.cli_errors import closest_flag, flags_of
from runtime.config import load_config

ROOT = Path(__file__).resolve().parents[3]


@dataclasses.dataclass
class Optim:
    lr: float = 1e-6
    """Learning rate."""


@dataclasses.dataclass
class Cfg:
    steps: int = 3
    """Steps."""
    mode: Literal["fast", "exact"] = "fast"
    """A choice."""
    burst: bool = False
    """A switch."""
    optim: Optim = dataclasses.field(default_factory=Optim)
    """Nested."""


def _error(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        load_config(Cfg, argv)
    assert isinstance(info.value.code, str)  # a message: the interpreter prints it and exits 1
    assert "\n" not in info.value.code
    return info.value.code


def test_a_wrong_flag_type_or_choice_is_one_line_naming_the_flag():
    assert _error(["--optim.l", "1"]) == "error: unknown flag --optim.l; did you mean --optim.lr?"
    assert _error(["--lr", "1"]) == "error: unknown flag --lr; did you mean --optim.lr?"
    assert _error(["--steps", "many"]).startswith("error: --steps: expected INT (invalid literal for int()")
    assert _error(["--mode", "quick"]) == "error: --mode 'quick': expected one of fast, exact"
    assert _error(["--steps"]) == "error: --steps: expected INT, got no value"
    assert _error(["--burst", "yes"]) == "error: unexpected argument 'yes'"
    assert _error(["--zzz"]) == "error: unknown flag --zzz"


def test_the_known_flags_are_tyros_spelling():
    flags = flags_of(Cfg)
    assert flags == ["--steps", "--mode", "--burst", "--no-burst", "--optim.lr"]
    assert closest_flag("--optim_lr=3", flags) == "--optim.lr"


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )


def test_a_role_refuses_a_misspelt_flag_in_one_line_with_exit_1():
    done = _run("reward_service", "--brokr.url", "redis://h:1/0")
    assert done.returncode == 1
    assert done.stderr == "error: unknown flag --brokr.url; did you mean --broker.url?\n"
    done = _run("reward_service", "--log-level", "LOUD")
    assert (done.returncode, done.stderr.count("\n")) == (1, 1)
    assert "--log-level 'LOUD': expected one of DEBUG, INFO" in done.stderr


@pytest.mark.parametrize(
    ("module", "args", "usage"),
    [
        ("reward_service", [], "usage: python -m reward_service "),
        ("learner", [], "usage: python -m learner "),
        ("tasks", ["synthetic"], "usage: python -m tasks synthetic "),
        ("broker", [], "usage: python -m broker "),
    ],
)
def test_help_names_the_command_not_a_file(module, args, usage):
    done = _run(module, *args, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(usage)
    assert "__main__.py" not in done.stdout
