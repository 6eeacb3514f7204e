"""Reading deploy/docker-compose.yml without Docker: YAML plus Compose's variable interpolation.

`load_compose(env)` returns the file as Compose would see it with the variables in `env`
(`${X}`, `${X:-default}`, `${X-default}`, `${X:?error}`, `${X?error}`, `$$`); a required variable
that is missing raises `KeyError` naming it. Used by the deployment tests, which cannot rely on a
Docker engine or the compose plugin being installed.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "deploy" / "docker-compose.yml"
_VAR = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """Substitute variables in every string of a loaded YAML value (dicts and lists recursively)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m["name"], m["op"] or "", m["arg"]
        # ":-" and ":?" treat an empty value like an unset one; "-" and "?" only an unset one.
        present = name in env and (env[name] != "" or not op.startswith(":"))
        if present:
            return env[name]
        if op.endswith("?"):
            raise KeyError(f"{name}: {arg}")
        return arg if op.endswith("-") else ""

    return _VAR.sub(one, value)


def load_compose(env: dict[str, str], path: Path = COMPOSE_FILE) -> dict:
    """The compose file as Compose resolves it under `env` (YAML anchors and merge keys included)."""
    return interpolate(yaml.safe_load(Path(path).read_text()), env)
