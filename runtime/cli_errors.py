"""Command-line errors in one line, like a config file's: `error: unknown flag --lr; did you mean --optim.lr?`

tyro reports a rejected command line (an unknown flag, a value of the wrong type, a choice outside a
`Literal`, a missing value) in a multi-line box and exits 2; a TOML file's mistakes are one line and exit 1
(runtime/config.py). `one_line_errors(*config_classes)` makes tyro's rejections the same: inside it a parse
error raises `ConfigError` with one line naming the flag and what was expected (and, for an unknown flag,
the closest known one), which `load_config` turns into `error: ...` and exit 1.

It uses tyro's parse-error hook (`tyro._errors.on_parse_error`, marked experimental by tyro: the version
is pinned in requirements.txt); where a tyro lacks it, tyro's own error box stays.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import typing
from collections.abc import Iterator


def flags_of(cls: type, prefix: str = "") -> list[str]:
    """Every flag tyro makes of a config dataclass: `--section.field-name`, and `--no-...` for booleans."""
    hints = typing.get_type_hints(cls)
    flags: list[str] = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name.replace("_", "-")
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            flags += flags_of(hint, name + ".")
        elif hint is bool:
            head, _, leaf = name.rpartition(".")
            flags += [f"--{name}", f"--{head}{'.' if head else ''}no-{leaf}"]
        else:
            flags.append(f"--{name}")
    return flags


def closest_flag(token: str, flags: list[str]) -> str | None:
    """The known flag `token` most likely meant: one with the same last name (`--learner.lr` ->
    `--learner.optim.lr`), else one spelled alike; None if nothing is close."""
    name = token.split("=", 1)[0].replace("_", "-")
    leaf = name.rsplit(".", 1)[-1].removeprefix("--")
    same_leaf = [f for f in flags if f.rsplit(".", 1)[-1].removeprefix("--") == leaf]
    close = difflib.get_close_matches(name, same_leaf or flags, n=1, cutoff=0.0 if same_leaf else 0.6)
    return close[0] if close else None


def describe(event, flags: list[str]) -> str:
    """One line for a tyro parse-error event (any kind; an unknown kind still gets a line)."""
    from tyro import _errors as e

    if isinstance(event, e.UnrecognizedArgs):
        unknown = [t for t in event.tokens if t.startswith("-")]
        if not unknown:
            return f"unexpected argument {event.tokens[0]!r}"
        guess = closest_flag(unknown[0], flags)
        return f"unknown flag {unknown[0].split('=', 1)[0]}" + (f"; did you mean {guess}?" if guess else "")
    if isinstance(event, e.InvalidChoice):
        choices = ", ".join(event.choices)
        return f"{_flag(event.argument)} {event.value!r}: expected one of {choices}"
    if isinstance(event, e.BadValue):
        if event.offending_value is None:
            return f"{_flag(event.argument)}: expected {_metavar(event.argument)}, got no value"
        return f"{_flag(event.argument)} takes no value, got {event.offending_value!r}"
    if isinstance(event, e.InstantiationFailure):
        if event.argument is None:
            return event.message
        return f"{_flag(event.argument)}: expected {_metavar(event.argument)} ({event.message})"
    if isinstance(event, e.MissingArgs):
        return "missing flag(s) " + ", ".join(_flag(a.arg) for a in event.missing_arguments)
    if isinstance(event, e.MissingSubcommand):
        got = f", got {event.found_token!r}" if event.found_token else ""
        return f"expected a command: one of {', '.join(event.subcommand_spec.parser_from_name)}{got}"
    return f"invalid command line ({type(event).__name__}); see {event.prog} --help"


@contextlib.contextmanager
def one_line_errors(*config_classes: type) -> Iterator[None]:
    """Inside: a tyro.cli call that rejects its command line raises ConfigError (one line) instead of
    printing a box and exiting 2. `config_classes` give the known flags for "did you mean"."""
    from runtime.config import ConfigError

    try:
        from tyro._errors import on_parse_error
    except ImportError:  # a tyro without the hook: its own error box
        yield
        return
    flags = [flag for cls in config_classes for flag in flags_of(cls)]

    def hook(event) -> None:
        try:
            line = describe(event, flags)
        except Exception:  # noqa: BLE001 - the event's fields are tyro internals: never lose the error
            line = "invalid command line; see --help"
        raise ConfigError(line)

    with on_parse_error(hook):
        yield


def _flag(argument) -> str:
    return "/".join(argument.lowered.name_or_flags) or str(argument.lowered.metavar)


def _metavar(argument) -> str:
    return str(argument.lowered.metavar or "a value")
