"""The manifest of a checkpoint: every file's size and sha256, written last, checked before a load.

    write_manifest(directory)   # after every other file of the checkpoint is written and fsynced
    verify(directory)           # raises CorruptCheckpoint naming the file and what is wrong with it

`manifest.json` is `{"format": 1, "files": {"model.safetensors": {"size": ..., "sha256": ...}, ...}}`,
written to `manifest.json.tmp`, fsynced and renamed into place, so that a manifest exists completely or
not at all, and only once every file it lists is durable. A checkpoint written before manifests existed
has none: `verify` returns False for it (loadable, unverified) and the caller says so in its log.
Hashing reads every byte once (about 1-2 GB/s a core with hashlib's sha256), right after the files
were written, while they are still in the page cache.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
FORMAT = 1


class CorruptCheckpoint(RuntimeError):
    """A checkpoint whose files do not match its manifest (or cannot be read); the message names the file."""


def write_manifest(directory: Path) -> Path:
    """List every file of `directory` (size, sha256) in its manifest, atomically; returns its path."""
    files = {
        f.name: {"size": f.stat().st_size, "sha256": file_sha256(f)}
        for f in sorted(directory.iterdir())
        if f.is_file() and not f.name.startswith(MANIFEST)
    }
    tmp = directory / (MANIFEST + ".tmp")
    with open(tmp, "w") as out:
        json.dump({"format": FORMAT, "files": files}, out, indent=1)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, directory / MANIFEST)
    return directory / MANIFEST


def verify(directory: Path) -> bool:
    """True when every file of the manifest is there with its size and sha256; False when the checkpoint
    has no manifest (written before manifests); CorruptCheckpoint naming the first file that differs."""
    path = directory / MANIFEST
    if not path.is_file():
        return False
    try:
        files = json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpoint(f"{path}: unreadable manifest ({exc})") from None
    for name, want in files.items():
        f = directory / name
        if not f.is_file():
            raise CorruptCheckpoint(f"{f}: missing (the manifest lists it)")
        size = f.stat().st_size
        if size != want["size"]:
            raise CorruptCheckpoint(f"{f}: {size} bytes, the manifest says {want['size']} (truncated?)")
        if file_sha256(f) != want["sha256"]:
            raise CorruptCheckpoint(f"{f}: sha256 differs from the manifest's (the file changed on disk)")
    return True


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
