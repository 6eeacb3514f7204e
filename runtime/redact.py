"""Keep secrets out of files and logs: URL passwords and secret fields become `***`.

`redact(text)` rewrites every `scheme://[user]:password@host` in a string to
`scheme://[user]:***@host`; `redact_tree(obj)` does it for every string inside nested dicts and
lists, and replaces the whole value of every secret field, a key named password, token, secret or
key, or ending in one of those after an underscore (`weight_sync.token`, `api_key`; not
`password_file`, a path), with *** (what `runtime.config.write_resolved` stores in a run directory).
`setup_logging(level, fmt)` is `logging.basicConfig` whose handlers redact every formatted line,
tracebacks included; every process entry point calls it instead of `basicConfig`.

    from runtime.redact import setup_logging
    setup_logging("INFO", "%(asctime)s %(name)s %(levelname)s %(message)s")
"""

from __future__ import annotations

import logging
import re

MASK = "***"
"""What a password is replaced by (a URL whose password is MASK has no password)."""

SECRET_FIELD = re.compile(r"(^|_)(password|passwd|token|secret|key)$", re.IGNORECASE)
"""Names of config fields whose values are secrets."""
_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)(?P<password>[^\s@/]+)(?=@)")


def redact(text: str) -> str:
    """`text` with the password of every URL in it replaced by ***."""
    return _URL_PASSWORD.sub(lambda m: m["head"] + MASK, text)


def redact_tree(obj):
    """A copy of nested dicts/lists/tuples with every string redacted and every secret field's
    non-empty value replaced by ***."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {key: _redact_field(key, value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact_tree(value) for value in obj)
    return obj


def _redact_field(key, value):
    if isinstance(key, str) and SECRET_FIELD.search(key) and value not in (None, "", b""):
        return MASK
    return redact_tree(value)


class RedactingFormatter(logging.Formatter):
    """Wraps another formatter; its output never holds a URL password."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return redact(self.inner.format(record))


def setup_logging(
    level: str | int = "INFO", fmt: str = "%(asctime)s %(name)s %(levelname)s %(message)s"
) -> None:
    """`logging.basicConfig(level, format)`, then every root handler redacts what it writes."""
    logging.basicConfig(level=level, format=fmt)
    for handler in logging.getLogger().handlers:
        if not isinstance(handler.formatter, RedactingFormatter):
            handler.setFormatter(RedactingFormatter(handler.formatter or logging.Formatter(fmt)))
