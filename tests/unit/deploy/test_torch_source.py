"""deploy/torch_source.py: which source `./run setup` takes torch's CPU build from, with a fake pip and
local indexes only (no network)."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from deploy.torch_source import NoTorchSource, torch_source

ROOT = Path(__file__).resolve().parents[3]
PIN = "torch==2.13.0+cpu"

FAKE_PIP = """
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_PIP_LOG"], "a") as log:
    log.write(json.dumps(args) + "\\n")
serves = os.environ["FAKE_PIP_SERVES"]  # "offline", "online" or "none"
offline = "--no-index" in args
sys.exit(0 if serves == "offline" or (serves == "online" and not offline) else 1)
"""


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """A pip that serves the pin from its find-links ("offline"), its configured index ("online") or not
    at all, and logs every call."""
    script = tmp_path / "fake_pip.py"
    script.write_text(FAKE_PIP)
    log = tmp_path / "pip.log"
    monkeypatch.setenv("FAKE_PIP_LOG", str(log))

    def make(serves: str):
        monkeypatch.setenv("FAKE_PIP_SERVES", serves)
        return [sys.executable, str(script)]

    make.calls = lambda: [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return make


@pytest.fixture
def index_server(tmp_path):
    """A PEP 503 index on 127.0.0.1 that has a page for torch."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<html><body></body></html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/whl/cpu"


def test_the_local_sources_win_offline_and_nothing_else_is_asked(fake_pip):
    pip = fake_pip("offline")
    assert torch_source(PIN, pip, closed_port_url()) == []
    calls = fake_pip.calls()
    assert len(calls) == 1, "one offline probe, no online probe"
    assert calls[0][:3] == ["install", "--dry-run", "--no-deps"] and "--no-index" in calls[0]
    assert calls[0][-1] == PIN


def test_an_index_pip_is_configured_with_is_used_as_it_is(fake_pip):
    pip = fake_pip("online")
    assert torch_source(PIN, pip, closed_port_url()) == []
    offline, online = fake_pip.calls()
    assert "--no-index" in offline and "--no-index" not in online
    assert online[online.index("--timeout") + 1] == "5" and online[online.index("--retries") + 1] == "0"


def test_the_pytorch_index_is_added_when_pip_lacks_the_build_and_it_answers(fake_pip, index_server):
    assert torch_source(PIN, fake_pip("none"), index_server) == ["--extra-index-url", index_server]


def test_a_local_mirror_directory_counts_as_reachable(fake_pip, tmp_path):
    (tmp_path / "mirror" / "torch").mkdir(parents=True)
    url = (tmp_path / "mirror").as_uri()
    assert torch_source(PIN, fake_pip("none"), url) == ["--extra-index-url", url]


@pytest.mark.parametrize("kind", ["closed port", "missing directory", "no torch page"])
def test_an_unreachable_index_stops_with_the_index_and_the_mirror_variable(
    fake_pip, tmp_path, index_server, kind
):
    url = {
        "closed port": closed_port_url(),
        "missing directory": (tmp_path / "nowhere").as_uri(),
        "no torch page": f"{index_server}/no/such/index",
    }[kind]
    with pytest.raises(NoTorchSource) as e:
        torch_source(PIN, fake_pip("none"), url)
    message = str(e.value)
    assert PIN in message and url in message
    assert "PARALLAX_TORCH_INDEX=URL" in message and "https://download.pytorch.org/whl/cpu" in message


def test_the_script_prints_the_options_and_reads_the_mirror_from_the_environment(tmp_path):
    """Run as `./run setup` runs it: the real pip of this interpreter with no find-links or index that
    serves the pin, and a mirror named by PARALLAX_TORCH_INDEX."""
    (tmp_path / "mirror" / "torch").mkdir(parents=True)
    url = (tmp_path / "mirror").as_uri()
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {
        "PATH": "/usr/bin:/bin",
        "PARALLAX_TORCH_INDEX": url,
        "PIP_CONFIG_FILE": "/dev/null",
        "PIP_FIND_LINKS": str(empty),
        "PIP_INDEX_URL": empty.as_uri(),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "torch_source.py"), "torch==0.0.1+cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["--extra-index-url", url]
    assert f"from {url}" in done.stderr
