"""runtime.private: run directories 0700, files 0600, secrets written atomically and read back."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

from runtime.private import new_secret, private_dir, read_secret, write_secret


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_private_dir_and_secret_files(tmp_path):
    loose = tmp_path / "run"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    assert mode(private_dir(loose)) == 0o700  # an existing directory is closed too
    path = write_secret(loose / "secrets" / "broker.password", "s3cret")
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert read_secret(path) == "s3cret"
    write_secret(path, "again")
    assert read_secret(path) == "again" and [p.name for p in path.parent.iterdir()] == ["broker.password"]
    a, b = new_secret(), new_secret()
    assert a != b and len(a) >= 40 and a.replace("-", "").replace("_", "").isalnum()


def test_private_umask_makes_what_a_process_and_its_children_write_private(tmp_path):
    code = (
        "from runtime.private import private_umask; import subprocess, sys; private_umask(); "
        f"open({str(tmp_path / 'own')!r}, 'w').close(); "
        f"subprocess.run(['touch', {str(tmp_path / 'child')!r}], check=True); "
        f"import os; os.mkdir({str(tmp_path / 'dir')!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert mode(tmp_path / "own") == 0o600 and mode(tmp_path / "child") == 0o600
    assert mode(tmp_path / "dir") == 0o700
