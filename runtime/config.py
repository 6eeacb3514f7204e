"""Config loading shared by every process entry point.

Each role has ONE config dataclass (fields documented by a docstring under each field).
`load_config(Cls, argv)` resolves it in this order: dataclass defaults, then an optional
`--config path.toml` (hand-written files live in deploy/configs/), then CLI flags (tyro).
`write_resolved(cfg, run_dir)` stores the result in the run directory as TOML-like JSON.

`apply_gpus(spec)` turns `--gpus 0-5` into CUDA_VISIBLE_DEVICES; call it before importing torch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


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


def from_dict(cls: type[T], data: dict) -> T:
    """Build a (possibly nested) config dataclass from a dict; unknown keys are an error."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(data) - set(names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown config keys {sorted(unknown)}")
    import typing

    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        hint = hints.get(key)
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = from_dict(hint, value)
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)  # TOML has arrays only; tuple fields stay tuples
        kwargs[key] = value
    return cls(**kwargs)


def load_config(cls: type[T], argv: list[str] | None = None, description: str | None = None) -> T:
    """Defaults < TOML file given by --config < command-line flags."""
    import sys

    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    path, rest = _split_config_flag(argv)
    default = cls()
    if path:
        with open(path, "rb") as f:
            default = from_dict(cls, tomllib.load(f))
    return tyro.cli(cls, args=rest, default=default, description=description)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def write_resolved(cfg, run_dir: str | os.PathLike, name: str) -> Path:
    """Write the resolved config as JSON into the run directory and return the path."""
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
