"""The run's credentials: the broker password and the message key, in RUN_DIR/secrets/ (0700, files 0600).

    creds = RunCredentials.prepare(run_dir, password_file="")
    creds.password_file, creds.key_file   # what the roles read (BrokerConfig.password_file, auth_key_file)

The broker password (Redis's `default` user; the ZeroMQ broker's PLAIN password) is, in this order:
the first line of the launcher's `--broker-password-file`, $PARALLAX_BROKER_PASSWORD, the one a resumed
run stored, or a fresh one. The message key that signs every stream entry (broker/auth.py) is
$PARALLAX_BROKER_AUTH_KEY, else the stored one, else a fresh one; it is kept so that a resumed run
still verifies the entries that were in flight when it stopped. Neither ever goes on a command line or
into a resolved config: the roles get the two file paths, the redis-server a 0600 config file
(broker/redis_server.py), the ZeroMQ broker `--password-file`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from broker.config import AUTH_KEY_ENV, PASSWORD_ENV
from runtime.private import new_secret, private_dir, read_secret, write_secret

SECRETS_DIR = "secrets"
PASSWORD_FILE = "broker.password"
KEY_FILE = "message.key"


@dataclass(frozen=True)
class RunCredentials:
    """Paths of the run's two secret files (mode 0600 in a 0700 directory)."""

    password_file: Path
    key_file: Path

    @property
    def password(self) -> str:
        return read_secret(self.password_file) or ""

    @classmethod
    def prepare(cls, run_dir: Path, password_file: str = "") -> RunCredentials:
        """Choose (see the module docstring), store and return the run's credentials."""
        folder = private_dir(Path(run_dir) / SECRETS_DIR)
        password_path, key_path = folder / PASSWORD_FILE, folder / KEY_FILE
        password = (
            (read_secret(password_file) if password_file else None)
            or os.environ.get(PASSWORD_ENV)
            or (read_secret(password_path) if password_path.is_file() else None)
            or new_secret()
        )
        key = (
            os.environ.get(AUTH_KEY_ENV)
            or (read_secret(key_path) if key_path.is_file() else None)
            or new_secret()
        )
        write_secret(password_path, password)
        write_secret(key_path, key)
        return cls(password_path, key_path)
