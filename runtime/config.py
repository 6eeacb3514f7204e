"""Config loading shared by every process entry point: the one place where configs are checked.

Each process has ONE config dataclass made of sections (dataclasses, a docstring under each
field; shared sections: `broker.config.BrokerConfig`, `runtime.metrics.MetricsConfig`).
`load_config(Cls, argv)` resolves it in this order: dataclass defaults, then an optional
`--config path.toml` (hand-written files live in deploy/configs/), then CLI flags (tyro); then it
calls `validate()` on every section that has one, innermost first. The style:

* a choice is a `Literal[...]` type and nothing else: the TOML reader and tyro both refuse any
  other value, naming the field and the allowed values;
* a wrong type in a TOML file is an error naming the file, the key and the expected type;
* cross-field rules live in the section's `validate()` (raise ValueError), never in
  `__post_init__`, and nobody else calls them: the loader does, after TOML and flags are merged;
* settings that exist only for one variant of something (one policy loss, one weight transport)
  live in that variant's own dataclass, and the field is a union of them picked by `type`
  (runtime/variants.py): `[loss.policy] type = "gspo"` in TOML, `--loss.policy.type gspo` as a flag.

Errors are `ConfigError` (a ValueError); `load_config` turns them into `SystemExit("error: ...")`
so that a process with a bad config exits 1 with one clear line; so does a wrong flag, type or choice on
the command line (runtime/cli_errors.py). `from_dict` (configs handed to child processes as JSON)
type-checks and validates the same way. `write_resolved(cfg, run_dir, name)` stores the result as JSON
with every URL password replaced by *** (runtime/redact.py).

`apply_gpus(spec)` turns `--gpus 0-5` into CUDA_VISIBLE_DEVICES; call it before importing torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Literal, TypeVar, Union

from runtime.redact import redact_tree
from runtime.variants import choose, pick, variants

T = TypeVar("T")


class ConfigError(ValueError):
    """An unknown key, a value of the wrong type, or a section whose validate() refused it."""


def load_config(
    cls: type[T],
    argv: list[str] | None = None,
    description: str | None = None,
    default: T | None = None,
    prog: str | None = None,
) -> T:
    """Defaults (`default`, else the dataclass's) < TOML file given by --config < command-line flags,
    then validated. `prog` names the command in --help (default: `python -m <the running package>`)."""
    import tyro

    from runtime.cli_errors import one_line_errors

    argv = list(sys.argv[1:] if argv is None else argv)
    path, rest = _split_config_flag(argv)
    try:
        if path:
            default = read_toml(cls, path, base=default)
        if default is None and not _required(cls):
            default = build(cls, {})
        if default is not None:
            default, rest = _choose(default, rest)
        with one_line_errors(cls):
            cfg = tyro.cli(
                cls,
                args=rest,
                default=default,
                description=description,
                prog=prog or main_prog(),
                config=(tyro.conf.AvoidSubcommands,),
            )
        validate(cfg)
    except ConfigError as exc:
        raise SystemExit(f"error: {exc}") from None
    return cfg


def main_prog() -> str | None:
    """`python -m <package>` when this process was started with -m (else None: tyro shows argv[0])."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return f"python -m {spec.name.removesuffix('.__main__')}" if spec is not None else None


def read_toml(cls: type[T], path: str | os.PathLike, base: T | None = None) -> T:
    """`cls` built from a TOML file over `base` (types checked; not validated: flags may still change it)."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    return build(cls, data, source=str(path), base=base)


def from_dict(cls: type[T], data: dict, source: str = "") -> T:
    """`cls` built from a dict (e.g. JSON from a parent process), type-checked and validated."""
    cfg = build(cls, data, source=source)
    validate(cfg)
    return cfg


def build(cls: type[T], data: dict, source: str = "", prefix: str = "", base: T | None = None) -> T:
    """A (possibly nested) config dataclass from a dict; unknown keys and wrong types are errors.

    Keys the dict leaves out keep their values in `base`, else the field defaults (a nested section
    starts from its parent's default for it, e.g. a role's own claim_idle_s)."""
    where = f"{source}: " if source else ""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}{prefix.rstrip('.') or cls.__name__}: expected a table, got {_kind(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        section = f" [{prefix.rstrip('.')}]" if prefix else ""
        raise ConfigError(f"{where}unknown config keys{section} {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint) or variants(hint):
            section = getattr(base, key) if base is not None else _field_default(fields[key])
            build_section = build_variant if variants(hint) else build
            kwargs[key] = build_section(hint, value, source, prefix + key + ".", base=section)
        else:
            kwargs[key] = _convert(value, hint, prefix + key, source)
    if base is not None:
        return dataclasses.replace(base, **kwargs)
    missing = [name for name in _required(cls) if name not in data]
    if missing:
        raise ConfigError(f"{where}missing config keys {[prefix + name for name in missing]}")
    return cls(**kwargs)


def _choose(default: T, argv: list[str]) -> tuple[T, list[str]]:
    """`default` with the variants that flags like `--loss.policy.type gspo` pick (tyro then parses the
    chosen variant's fields), and the flags left for tyro."""
    try:
        return choose(default, argv)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _required(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if _field_default(f) is dataclasses.MISSING]


def build_variant(hint, data, source: str, prefix: str, base=None):
    """The variant of the union `hint` that `data["type"]` names (else `base`'s), built over `base` when
    it is that variant, else from the variant's defaults; a bare string is short for {"type": it}."""
    choices = variants(hint)
    data = {"type": data} if isinstance(data, str) else data
    if not isinstance(data, dict):
        where = f"{source}: " if source else ""
        raise ConfigError(f"{where}{prefix.rstrip('.')}: expected a table, got {_kind(data)}")
    name = data.get("type", getattr(base, "type", None))
    try:
        variant = pick(choices, name, f"{source + ': ' if source else ''}{prefix}type")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return build(variant, data, source, prefix, base=base if isinstance(base, variant) else None)


def _field_default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def validate(cfg, path: str = "") -> None:
    """Call `validate()` on every dataclass section of `cfg` (innermost first), then on `cfg`."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            validate(value, f"{path}{f.name}.")
    check = getattr(cfg, "validate", None)
    if check is None:
        return
    try:
        check()
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(f"{path.rstrip('.') or type(cfg).__name__}: {exc}") from None


def _convert(value, hint, key: str, source: str):
    """`value` checked against the type `hint` (TOML arrays become tuples where a tuple is wanted)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return build(hint, value, source, prefix=key + ".")
    if origin is Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise _wrong(source, key, value, "one of " + ", ".join(map(repr, args)))
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arm in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arm, key, source)
            except ConfigError:
                continue
        raise _wrong(source, key, value, _name(hint))
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise _wrong(source, key, value, _name(hint))
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise _wrong(source, key, value, f"{_name(hint)} ({len(args)} items)")
            items = [_convert(v, a, f"{key}[{i}]", source) for i, (v, a) in enumerate(zip(value, args))]
        else:
            arg = args[0] if args else typing.Any
            items = [_convert(v, arg, f"{key}[{i}]", source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong(source, key, value, _name(hint))
        arg = args[1] if args else typing.Any
        return {k: _convert(v, arg, f"{key}.{k}", source) for k, v in value.items()}
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _wrong(source, key, value, "float")
    if hint in (int, bool, str):
        if type(value) is hint:
            return value
        raise _wrong(source, key, value, hint.__name__)
    if hint is Path:
        if isinstance(value, (str, Path)):
            return Path(value)
        raise _wrong(source, key, value, "a path (string)")
    return value  # Any and other unchecked types


def _wrong(source: str, key: str, value, expected: str) -> ConfigError:
    where = f"{source}: " if source else ""
    return ConfigError(f"{where}{key} = {value!r}: expected {expected}, got {_kind(value)}")


def _kind(value) -> str:
    return {dict: "a table", list: "an array"}.get(type(value), type(value).__name__)


def _name(hint) -> str:
    return getattr(hint, "__name__", None) if not typing.get_args(hint) else str(hint).replace("typing.", "")


def _split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    rest, path, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def to_dict(cfg) -> dict:
    """The config as plain data, every URL password replaced by *** (what may reach a file or a log)."""
    return redact_tree(dataclasses.asdict(cfg))


def write_resolved(cfg, run_dir: str | os.PathLike, name: str) -> Path:
    """Write the resolved config (passwords redacted) as JSON into the run directory; returns the path."""
    out = Path(run_dir) / f"config.{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(to_dict(cfg), indent=2, default=str) + "\n")
    return out


def parse_gpus(spec: str) -> list[int]:
    """ "0-5" -> [0..5]; "6,7" -> [6, 7]; "" -> []."""
    gpus: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        if "-" in part:
            lo, hi = part.split("-", 1)
            gpus.extend(range(int(lo), int(hi) + 1))
        else:
            gpus.append(int(part))
    return gpus


def apply_gpus(spec: str | None) -> list[int]:
    """Set CUDA_VISIBLE_DEVICES from a --gpus spec (must run before torch is imported)."""
    if not spec:
        return []
    gpus = parse_gpus(spec)
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    return gpus
