"""Variant sections of a config: a field whose type is a union of dataclasses, picked by `type`.

Each variant is a dataclass whose first field is `type: Literal["<name>"] = "<name>"` and whose
other fields are its own parameters only, e.g.

    @dataclass
    class GspoLoss:
        type: Annotated[Literal["gspo"], POLICY_TYPES] = "gspo"   # POLICY_TYPES = choices_shown(...)
        clip_low: float = 3e-4

    policy: PpoClipLoss | GspoLoss | CispoLoss | SapoLoss = field(default_factory=PpoClipLoss)

In TOML the variant is a table: `[loss.policy]` with `type = "gspo"` and its parameters (a table
without `type` tunes the variant already chosen; `policy = "gspo"` is short for a table holding
only `type`). On the command line `--loss.policy.type gspo` (or `--loss.policy gspo`) picks it and
its parameters are flags like any other (`--loss.policy.clip-low 1e-3`). runtime/config.py builds
variants from TOML (`build_variant`); `choose` applies the picking flags before tyro parses the
rest, and tyro, told to avoid subcommands, shows and parses the chosen variant's fields.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Union

TYPE = "type"
"""The field of every variant that names it."""


def choices_shown(*names: str) -> object:
    """`Annotated[Literal["gspo"], choices_shown(...all names)]` on a variant's `type` field makes the help
    list every variant there, not only the one chosen."""
    import tyro

    return tyro.conf.arg(metavar="{" + ",".join(names) + "}")


def variants(hint) -> dict[str, type] | None:
    """{name: class} of a union of variant dataclasses (each with a `type` field), else None."""
    if typing.get_origin(hint) not in (Union, types.UnionType):
        return None
    arms = typing.get_args(hint)
    if not all(dataclasses.is_dataclass(arm) and _has_type_field(arm) for arm in arms):
        return None
    return {name_of(arm): arm for arm in arms}


def name_of(cls: type) -> str:
    """The variant's name: the default of its `type` field."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == TYPE)


def _has_type_field(cls: type) -> bool:
    return any(f.name == TYPE and isinstance(f.default, str) for f in dataclasses.fields(cls))


def pick(choices: dict[str, type], name, where: str):
    """The class named `name`, else a ValueError naming `where` and the choices."""
    if isinstance(name, str) and name in choices:
        return choices[name]
    allowed = ", ".join(map(repr, choices))
    raise ValueError(f"{where} = {name!r}: expected one of {allowed}")


def choose(cfg: Any, argv: list[str], prefix: str = "") -> tuple[Any, list[str]]:
    """`cfg` with the variant each picking flag in `argv` names (a fresh one, at its defaults, when it
    differs from the one `cfg` holds), and `argv` with every `--PATH NAME` spelled `--PATH.type NAME`.
    Raises ValueError for a name that is not one of the choices."""
    hints = typing.get_type_hints(type(cfg))
    changes = {}
    for f in dataclasses.fields(cfg):
        value, path = getattr(cfg, f.name), prefix + f.name
        choices = variants(hints[f.name])
        if choices is not None:
            name, argv = _picked(argv, path)
            if name is not None and name != getattr(value, TYPE, None):
                value = changes[f.name] = pick(choices, name, f"--{_flag(path)}.{TYPE}")()
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            inner, argv = choose(value, argv, path + ".")
            if inner is not value:
                changes[f.name] = inner
    return (dataclasses.replace(cfg, **changes) if changes else cfg), argv


def _picked(argv: list[str], path: str) -> tuple[str | None, list[str]]:
    """The last name given to `--PATH.type` or `--PATH` in argv (None if neither), and argv spelled
    with `--PATH.type` only."""
    short, full = f"--{_flag(path)}", f"--{_flag(path)}.{TYPE}"
    out, name, i = [], None, 0
    while i < len(argv):
        flag, eq, inline = argv[i].partition("=")
        if flag.startswith("--") and _flag(flag) in (short, full):
            if not eq and i + 1 >= len(argv):
                out.append(argv[i])  # no value: tyro reports it
                break
            name = inline if eq else argv[i + 1]
            out += [full, name]
            i += 1 if eq else 2
            continue
        out.append(argv[i])
        i += 1
    return name, out


def _flag(name: str) -> str:
    """A flag name as tyro spells it (dashes for underscores)."""
    return name.replace("_", "-")
