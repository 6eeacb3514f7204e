"""Every command the user documentation shows still parses.

Collects each `python -m MODULE ...` and `./run CMD ...` from README.md and docs/*.md, in fenced code
blocks and in inline code, and checks it against the code:

* `python -m MODULE [SUBCOMMAND] args`: `python -m MODULE [SUBCOMMAND] --help` exits 0, and every
  `--flag` of the command appears in that help (values may be placeholders such as PATH or RUN_DIR);
  a `--config FILE` goes into the `--help` call too, so the role's config loader reads and checks that
  file (runtime/config.py takes `--config` before its flags);
* `./run CMD args`: CMD is one of the commands `run` dispatches; `./run demo args` is checked as
  `python -m deploy args`, and `./run bench NAME` needs bench/NAME.py.

One `--help` subprocess per module (and subcommand), cached for the whole test run.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}
FLAG = re.compile(r"--[A-Za-z][\w.-]*")


def code_snippets(text: str) -> list[tuple[int, str]]:
    """(line number, text) of each fenced code block line (continuations joined) and inline code span."""
    out, block, lines = [], None, text.splitlines()
    pending, start = "", 0
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            block = None if block else line
            continue
        if block:
            if not pending:
                start = number
            pending += line.rstrip().removesuffix("\\") + " "
            if not line.rstrip().endswith("\\"):
                out.append((start, pending))
                pending = ""
        else:
            out += [(number, span) for span in re.findall(r"`([^`]+)`", line)]
    return out


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) for every `python -m` and `./run` command of the user documentation."""
    found = []
    for path in DOCS:
        for number, snippet in code_snippets(path.read_text()):
            snippet = re.split(r"(?:^|\s)#", snippet, maxsplit=1)[0]  # a shell comment names no command
            if snippet.startswith("run: "):  # a message ./run prints, quoted in the docs
                continue
            for match in re.finditer(r"(?<![\w.-])(python -m |\./run )", snippet):
                found.append((f"{path.relative_to(ROOT)}:{number}", snippet[match.start() :]))
    return found


def words(command: str) -> list[str]:
    """The command's words up to the first shell operator or `--` (what follows `--` is a wrapped
    command, checked on its own), comments dropped."""
    out = []
    for word in shlex.split(command, comments=True):
        if word in SHELL_OPERATORS or word == "--":
            break
        out.append(word)
    return out


@functools.cache
def help_text(argv: tuple[str, ...]) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    result = subprocess.run(
        [sys.executable, "-m", *argv, "--help"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (
        f"python -m {' '.join(argv)} --help exited {result.returncode}:\n{result.stderr}"
    )
    return result.stdout + result.stderr  # some entry points print their usage on stderr


def run_commands() -> set[str]:
    """The commands `run` dispatches: the labels of its `case` (`setup) ...`), less the fallback."""
    labels = re.findall(r"^\s+([\w| -]+)\)", (ROOT / "run").read_text(), flags=re.MULTILINE)
    return {name.strip() for label in labels for name in label.split("|")} - {"*"}


def check_module(args: list[str]) -> None:
    module, rest = args[0], args[1:]
    if module.rsplit(".", 1)[-1].isupper() or module == "...":  # a placeholder: bench.NAME, python -m ...
        return
    argv = (module,)
    if (
        rest
        and not rest[0].startswith("-")
        and re.search(rf"[{{,]{re.escape(rest[0])}[,}}]", help_text(argv))
    ):
        argv, rest = (module, rest[0]), rest[1:]
    rest = [
        part for word in rest for part in (word.split("=", 1) if word.startswith("--config=") else [word])
    ]
    if "--config" in rest:
        at = rest.index("--config")
        argv, rest = (*argv, "--config", rest[at + 1]), rest[:at] + rest[at + 2 :]
    known = {flag.rstrip(".") for flag in FLAG.findall(help_text(argv))}
    flags = [word.split("=", 1)[0] for word in rest if word.startswith("--")]
    missing = [flag for flag in flags if flag not in known]
    assert not missing, f"python -m {' '.join(argv)} has no {', '.join(missing)}"


def check_run(args: list[str]) -> None:
    assert args, "./run without a command"
    command, rest = args[0], args[1:]
    assert command in run_commands(), f"./run has no command {command!r} (it has {sorted(run_commands())})"
    if command == "demo":
        check_module(["deploy", *rest])
    elif command == "bench" and rest and not rest[0].isupper():
        assert (ROOT / "bench" / f"{rest[0]}.py").is_file(), f"./run bench {rest[0]}: no bench/{rest[0]}.py"


COMMANDS = documented_commands()


def test_the_documentation_shows_commands():
    assert len(COMMANDS) > 20
    assert any(command.startswith("./run demo") for _, command in COMMANDS)


def test_snippets_come_from_blocks_and_inline_code():
    text = "run `python -m a --x 1` here\n```bash\npython -m b --y \\\n    --z  # note\n```\n"
    assert code_snippets(text) == [(1, "python -m a --x 1"), (3, "python -m b --y      --z  # note ")]
    assert words("python -m b --y --z  # --w") == ["python", "-m", "b", "--y", "--z"]


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[where for where, _ in COMMANDS])
def test_documented_command_parses(where, command):
    args = words(command)
    if args[0] == "python":
        check_module(args[2:])
    else:
        check_run(args[1:])
