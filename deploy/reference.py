"""The configuration reference (docs/configuration.md), generated from the config dataclasses.

    python -m deploy.reference docs/configuration.md

Every process has one config dataclass (runtime/config.py); this walks each of them, section by
section, and writes one table per section: the flag, its TOML key, the type, the default and the
field's docstring. A section whose type is a union of dataclasses (a variant chosen by its `type`
field) gets one table per variant. tests/unit/deploy/test_config_reference.py fails when the committed page
differs from what this prints, so the page never drifts from the code.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import functools
import inspect
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Literal, Union

HEADER = """# Configuration reference

Generated from the config dataclasses by `python -m deploy.reference > docs/configuration.md`; do not
edit by hand. Each process reads, in order: the dataclass defaults, then `--config FILE.toml`, then
command-line flags. A TOML key `a.b.c` is the table `[a.b]` with the key `c`; the same field on the
command line is `--a.b.c VALUE`, with `-` for `_` (`--max-steps`, TOML `max_steps`). Under
`python -m deploy`, each role's section is nested under its name (`--learner.optim.lr`, `[learner.optim]`).
"""


def roles() -> list[tuple[str, type]]:
    """(command, config class) of every process, in the order the page lists them."""
    from deploy.plan import LaunchConfig
    from generator.config import GeneratorConfig
    from learner.config import LearnerConfig
    from reward_service.config import RewardConfig

    return [
        ("python -m learner", LearnerConfig),
        ("python -m generator", GeneratorConfig),
        ("python -m reward_service", RewardConfig),
        ("python -m deploy", LaunchConfig),
    ]


def render() -> str:
    """The whole page as Markdown."""
    parts = [HEADER]
    for command, cls in roles():
        parts.append(f"\n## `{command}`\n\n{_doc(cls)}\n")
        embedded = {r for _, r in roles() if r is not cls}
        parts.extend(_sections(cls, prefix="", embedded=embedded))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(parts)).rstrip() + "\n"


def _sections(cls: type, prefix: str, embedded: set[type]) -> list[str]:
    """The table of `cls`'s own fields, then one block per nested section (recursively)."""
    rows, nested = [], []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint, key = hints[f.name], prefix + f.name
        doc = field_docs(cls).get(f.name, "")
        variants = _dataclass_arms(hint)
        if dataclasses.is_dataclass(hint) and hint in embedded:
            nested.append(
                f"\n### `[{key}]`\n\n{_one_line(doc)} The section takes every field of "
                f"`{hint.__name__}`, listed under its own command above.\n"
            )
        elif dataclasses.is_dataclass(hint):
            nested.append(f"\n### `[{key}]`\n\n{_one_line(doc)}\n")
            nested.extend(_sections(hint, key + ".", embedded))
        elif variants:
            nested.append(
                f"\n### `[{key}]`\n\n{_one_line(doc)} One of: "
                + ", ".join(f"`{_variant_name(v)}`" for v in variants)
                + ".\n"
            )
            for arm in variants:
                nested.append(f"\n#### `[{key}]` `{_variant_name(arm)}`\n\n{_doc(arm)}\n")
                nested.extend(_sections(arm, key + ".", embedded))
        else:
            rows.append(
                f"| `--{key.replace('_', '-')}` | `{_type_name(hint)}` | {_default(f)} | {_one_line(doc)} |"
            )
    table = []
    if rows:
        table = ["\n| flag | type | default | what it does |", "|---|---|---|---|", *rows]
    return ["\n".join(table)] + nested if table else nested


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body (with inherited fields)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for stmt, after in zip(body, body[1:]):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _dataclass_arms(hint) -> list[type]:
    """The dataclass variants of a union type (Annotated wrappers removed); [] for anything else."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    if typing.get_origin(hint) not in (Union, types.UnionType):
        return []
    arms = [
        typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a
        for a in typing.get_args(hint)
    ]
    return [a for a in arms if dataclasses.is_dataclass(a)]


def _variant_name(cls: type) -> str:
    """A variant's `type` tag if it has one, else its class name."""
    for f in dataclasses.fields(cls):
        if f.name == "type" and isinstance(f.default, str):
            return f'type = "{f.default}"'
    return cls.__name__


def _type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " \\| ".join(repr(a).replace("'", '"') for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in args)
    if origin in (list, tuple, dict):
        inner = ", ".join("..." if a is Ellipsis else _type_name(a) for a in args)
        return f"{origin.__name__}[{inner}]"
    if hint is type(None):
        return "None"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return " \\| ".join(f'"{m.value}"' for m in hint)
    return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def _default(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    elif f.default is not dataclasses.MISSING:
        value = f.default
    else:
        return "required"
    if isinstance(value, enum.Enum):
        value = value.value
    text = repr(value).replace("'", '"').replace("|", "\\|")
    return f"`{text}`" if text else '`""`'


def _doc(cls: type) -> str:
    return _one_line(inspect.cleandoc(cls.__doc__ or ""))


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.reference", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", help="write the page to this file (default: standard output)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    page = render()
    if args.out:
        Path(args.out).write_text(page)
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
