"""`BrokerConfig`: the broker section of every role's config (where the broker is, how to use it).

Every process config has `broker: BrokerConfig` (TOML `[broker]`, flags `--broker.url`,
`--broker.namespace`, ...). The URL defaults to $PARALLAX_BROKER_URL, else a local Redis. The
broker password (Redis's, or the ZeroMQ broker's) is best kept out of the URL (a URL ends up in
`ps` and in files): give it as `password_file` (first line of a file, e.g. a mounted secret) or in
$PARALLAX_BROKER_PASSWORD; `connect()` puts it into the URL only when connecting. A password
inside the URL still works; resolved configs and logs show it as *** (runtime/redact.py).
The run's message key, which signs and verifies every stream entry (broker/auth.py), comes the
same way: `auth_key_file` or $PARALLAX_BROKER_AUTH_KEY. The byte caps (`max_entry_bytes`,
`max_blob_bytes`) bound what this process publishes and accepts.

    cfg.broker.connect()          # a broker.transport.Transport with this section's options
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

from broker.stream_options import StreamOptions
from runtime.private import read_secret
from runtime.redact import MASK

if TYPE_CHECKING:
    from broker.transport import Transport

log = logging.getLogger(__name__)

URL_ENV = "PARALLAX_BROKER_URL"
"""Environment variable of the default broker URL."""
PASSWORD_ENV = "PARALLAX_BROKER_PASSWORD"
"""Environment variable of the broker password (used when neither password_file nor the URL has one)."""
AUTH_KEY_ENV = "PARALLAX_BROKER_AUTH_KEY"
"""Environment variable of the run's message key (used when auth_key_file is empty)."""
DEFAULT_URL = "redis://127.0.0.1:6379/0"
SCHEMES = ("redis://", "rediss://", "unix://", "zmq://")


def default_url() -> str:
    """$PARALLAX_BROKER_URL, else a Redis on this host."""
    return os.environ.get(URL_ENV) or DEFAULT_URL


@dataclass
class BrokerConfig:
    """The run's broker: address, namespace, password and delivery options of this process's streams."""

    url: str = field(default_factory=default_url)
    """redis://host:port/db, rediss://..., unix:///path or zmq://host:port; default $PARALLAX_BROKER_URL,
    else redis://127.0.0.1:6379/0. A password may be inside (redis://:PASSWORD@host:port/db), but
    password_file or $PARALLAX_BROKER_PASSWORD keep it off command lines."""
    namespace: str = "parallax"
    """Namespace of this run's stream and key names (broker.names.Names); the same for every role of a run."""
    password_file: str = ""
    """File whose first line is the broker password ("" = the URL's, else $PARALLAX_BROKER_PASSWORD)."""
    auth_key_file: str = ""
    """File whose first line is the run's message key, shared by every role of the run: entries are
    signed with it and entries that do not verify are dead-lettered ("" = $PARALLAX_BROKER_AUTH_KEY;
    with neither, messages are not authenticated)."""
    max_entry_bytes: int = StreamOptions.max_entry_bytes
    """Largest stream entry published or accepted (larger ones are dead-lettered unread)."""
    max_blob_bytes: int = StreamOptions.max_blob_bytes
    """Largest blob (an encoded image) stored or accepted."""
    claim_idle_s: float = 600.0
    """Seconds an input entry may stay pending on one (dead) consumer before another reclaims it; each role
    documents what bounds it."""
    max_deliveries: int = 5
    """An input entry delivered this many times without an ack is dead-lettered."""

    def validate(self) -> None:
        if not self.url.startswith(SCHEMES):
            raise ValueError(f"url {self.url!r} must start with one of {', '.join(SCHEMES)}")
        if not self.namespace:
            raise ValueError("namespace must not be empty")
        for name in ("password_file", "auth_key_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"{name} {path} does not exist")
        if min(self.max_entry_bytes, self.max_blob_bytes) < 1024:
            raise ValueError("max_entry_bytes and max_blob_bytes must be >= 1024")
        StreamOptions(claim_idle_s=self.claim_idle_s, max_deliveries=self.max_deliveries).validate()

    def password(self) -> str | None:
        """password_file's first line, else the URL's own password, else $PARALLAX_BROKER_PASSWORD."""
        if self.password_file:
            return read_secret(self.password_file)
        own = _url_password(self.url)
        return own if own else os.environ.get(PASSWORD_ENV) or None

    def auth_key(self) -> str | None:
        """auth_key_file's first line, else $PARALLAX_BROKER_AUTH_KEY (None: no message authentication)."""
        if self.auth_key_file:
            return read_secret(self.auth_key_file)
        return os.environ.get(AUTH_KEY_ENV) or None

    def connect_url(self) -> str:
        """The URL to connect to, with the password in it (never write this one anywhere)."""
        password = self.password()
        if not password or password == _url_password(self.url):
            return self.url
        scheme, userinfo, rest = _split(self.url)
        user = userinfo.split(":", 1)[0]
        return f"{scheme}://{user}:{quote(password, safe='')}@{rest}"

    def connect(self, **opts) -> Transport:
        """A connected transport (`broker.connect`) with this section's delivery options."""
        import broker

        opts.setdefault("claim_idle_s", self.claim_idle_s)
        opts.setdefault("max_deliveries", self.max_deliveries)
        opts.setdefault("max_entry_bytes", self.max_entry_bytes)
        opts.setdefault("max_blob_bytes", self.max_blob_bytes)
        opts.setdefault("auth_key", self.auth_key())
        if opts["auth_key"] is None:
            log.warning(
                "no message key (auth_key_file, $%s): stream entries are neither signed nor verified, "
                "so anyone who can write to the broker can feed this run",
                AUTH_KEY_ENV,
            )
        return broker.connect(self.connect_url(), **opts)


def _url_password(url: str) -> str | None:
    """The password inside `url` (None when absent or redacted to ***)."""
    _, userinfo, _ = _split(url)
    password = userinfo.split(":", 1)[1] if ":" in userinfo else ""
    return unquote(password) if password and password != MASK else None


def _split(url: str) -> tuple[str, str, str]:
    """(scheme, userinfo, rest) of scheme://[userinfo@]rest."""
    scheme, _, tail = url.partition("://")
    userinfo, at, rest = tail.rpartition("@")
    return (scheme, userinfo, rest) if at else (scheme, "", tail)
