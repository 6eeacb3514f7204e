"""runtime.redact: URL passwords never reach a file or a log line."""

from __future__ import annotations

import io
import logging

from runtime.redact import RedactingFormatter, redact, redact_tree, setup_logging


def test_redact_replaces_only_passwords():
    assert redact("redis://:pw@host:1/0") == "redis://:***@host:1/0"
    assert redact("connect rediss://user:p%40ss@h:6380/2 now") == "connect rediss://user:***@h:6380/2 now"
    assert redact("redis://host:1/0 and zmq://127.0.0.1:5555") == "redis://host:1/0 and zmq://127.0.0.1:5555"
    assert redact("a=redis://:x@a:1/0 b=redis://:y@b:2/0") == "a=redis://:***@a:1/0 b=redis://:***@b:2/0"
    assert redact("http://host:8080/path") == "http://host:8080/path"  # a port is not a password


def test_redact_tree_reaches_nested_strings():
    tree = {"broker": {"url": "redis://:pw@h:1/0"}, "urls": ["redis://:pw@h:2/0"], "n": 3}
    assert redact_tree(tree) == {
        "broker": {"url": "redis://:***@h:1/0"},
        "urls": ["redis://:***@h:2/0"],
        "n": 3,
    }


def test_log_lines_and_tracebacks_are_redacted():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(RedactingFormatter(logging.Formatter("%(levelname)s %(message)s")))
    log = logging.getLogger("test-redact")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("connecting to %s", "redis://:pw-1@h:1/0")
        try:
            raise RuntimeError("failed: redis://:pw-2@h:1/0")
        except RuntimeError:
            log.exception("broker down")
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert "pw-1" not in text and "pw-2" not in text
    assert (
        "WARNING connecting to redis://:***@h:1/0" in text
        and "RuntimeError: failed: redis://:***@h:1/0" in text
    )


def test_setup_logging_wraps_every_root_handler():
    root = logging.getLogger()
    before = list(root.handlers)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    try:
        setup_logging("INFO")
        assert isinstance(handler.formatter, RedactingFormatter)
        logging.getLogger("x").warning("url redis://:secret@h:1/0")
        assert stream.getvalue() == "url redis://:***@h:1/0\n"
    finally:
        root.removeHandler(handler)
        for h in root.handlers:
            if h not in before:
                root.removeHandler(h)


def test_secret_fields_are_redacted_whole_but_paths_and_empty_ones_are_kept():
    cfg = {
        "weight_sync": {"token": "t0ken", "host": "h"},
        "broker": {"password": "pw", "password_file": "/run/secrets/p", "auth_key_file": "/k"},
        "api_key": "k3y",
        "secret": "s",
        "empty": {"token": ""},
        "keys": ["a"],
    }
    assert redact_tree(cfg) == {
        "weight_sync": {"token": "***", "host": "h"},
        "broker": {"password": "***", "password_file": "/run/secrets/p", "auth_key_file": "/k"},
        "api_key": "***",
        "secret": "***",
        "empty": {"token": ""},
        "keys": ["a"],
    }
