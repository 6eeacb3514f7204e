"""Private files and per-run secrets: what only the user who runs Parallax may read.

    private_umask()                # new files 0600, new directories 0700 (here and in children)
    run_dir = private_dir(path)    # mkdir -p with mode 0700, and 0700 if it existed
    write_secret(run_dir / "secrets" / "broker.password", new_secret())
    read_secret(path)                      # the first line of a secret file

The launcher and every role call `private_umask()` first thing, so that run directories,
checkpoints, logs, resolved configs and the redis-server's append-only file are not readable by
other users of the host. Secrets are drawn with `secrets.token_urlsafe` (URL-safe, so they also fit
inside a broker URL) and written atomically with mode 0600.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

PRIVATE_UMASK = 0o077
"""Files 0600, directories 0700."""


def private_umask() -> int:
    """Make every file this process (and any child it starts) creates private; returns the old umask."""
    return os.umask(PRIVATE_UMASK)


def private_dir(path: str | os.PathLike) -> Path:
    """`path` created with its parents (mode 0700), and made 0700 if it already existed."""
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def new_secret(nbytes: int = 32) -> str:
    """A fresh random secret, URL-safe text (`nbytes` random bytes)."""
    return secrets.token_urlsafe(nbytes)


def write_secret(path: str | os.PathLike, value: str) -> Path:
    """Write `value` (one line) to `path` with mode 0600, atomically; its directory is made 0700."""
    path = Path(path)
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    os.replace(tmp, path)
    return path


def read_secret(path: str | os.PathLike) -> str | None:
    """The first line of a secret file, stripped (None when the file is empty)."""
    lines = Path(path).read_text().splitlines()
    return lines[0].strip() or None if lines else None
