"""bench/device_queue.py: a queue started in the background runs every command in turn, passes variables from
one command to the later ones, keeps going past a failure, and a poll reports it and brings back logs and
results."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench.device_queue import fit_bundle, parse_queue, poll, start

ROOT = Path(__file__).resolve().parents[3]


def test_parse_queue_joins_continued_lines_and_drops_comments():
    text = "# a comment\n\necho a \\\n    b\n  # indented comment\necho c\n"
    assert parse_queue(text) == ["echo a b", "echo c"]
    with pytest.raises(ValueError, match="continued line"):
        parse_queue("echo a \\\n")


QUEUES = sorted((ROOT / "bench/queues").glob("*.txt"))


@pytest.mark.parametrize("queue", QUEUES, ids=lambda p: p.name)
def test_the_committed_queue_parses(queue):
    commands = parse_queue(queue.read_text())
    assert commands and all("\\" not in c for c in commands)
    assert all(c.startswith("timeout ") or " --timeout-s " in c for c in commands)  # none can hang the queue
    assert all("$QUEUE_RESULTS/" in c for c in commands)  # every result comes back


def _wait_done(qdir: Path, limit_s: float = 30.0) -> dict:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        state = json.loads((qdir / "state.json").read_text())
        if state["done"]:
            return state
        time.sleep(0.1)
    raise AssertionError(f"queue not done in {limit_s} s: {state}")


def test_a_queue_runs_in_the_background_and_a_poll_brings_back_its_logs_and_results(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # the runner is `python -m bench.device_queue`
    queue = tmp_path / "q.txt"
    queue.write_text(
        'false || echo "FLAG=\'--no-x\'" >> "$QUEUE_DIR/env"\n'
        "exit 3\n"
        'echo "flag=$FLAG" > "$QUEUE_RESULTS/r.txt"; echo done-three\n'
    )
    qdir = tmp_path / "queue"
    (tmp_path / "skip.txt").write_text("exit 5\ntrue\n")
    start(tmp_path / "skip.txt", tmp_path / "skipped", skip=1)  # the first command left out
    skipped = _wait_done(tmp_path / "skipped")["steps"]
    assert [(s["index"], s["rc"]) for s in skipped] == [(1, 0)]  # numbered as in the file
    start(queue, qdir)
    state = _wait_done(qdir)
    assert [s["rc"] for s in state["steps"]] == [0, 3, 0]  # a failure does not stop the queue
    flag = (qdir / "results/r.txt").read_text().strip()
    assert flag == "flag=--no-x"  # a variable set by an earlier command
    out = tmp_path / "out"
    assert poll(qdir, timeout_s=0.0, out=out)
    assert [p.name for p in out.iterdir()] == ["queue.tar.gz"]  # a call brings back 8 files at most
    with tarfile.open(out / "queue.tar.gz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    back = tmp_path / "back"
    assert (back / "results/r.txt").exists() and (back / "02.log").read_text().strip() == "done-three"
    assert json.loads((back / "state.json").read_text())["done"]
    assert (back / "env").read_text() == "FLAG='--no-x'\n"  # what a queue continued elsewhere needs


def test_a_new_queue_in_the_same_directory_starts_without_the_old_ones_variables(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    qdir = tmp_path / "queue"
    (tmp_path / "a.txt").write_text('echo "FLAG=x" >> "$QUEUE_DIR/env"\ntrue\ntrue\n')
    start(tmp_path / "a.txt", qdir)
    _wait_done(qdir)
    (tmp_path / "b.txt").write_text('echo "flag=$FLAG" > "$QUEUE_RESULTS/b.txt"\n')
    start(tmp_path / "b.txt", qdir)
    _wait_done(qdir)
    assert (qdir / "results/b.txt").read_text().strip() == "flag="
    assert not (qdir / "02.log").exists()  # the old queue's logs are gone
    (tmp_path / "c.txt").write_text('true\necho "flag=$FLAG" > "$QUEUE_RESULTS/c.txt"\n')
    start(tmp_path / "a.txt", qdir)
    _wait_done(qdir)
    start(tmp_path / "c.txt", qdir, skip=1)  # continuing a queue keeps its variables
    _wait_done(qdir)
    assert (qdir / "results/c.txt").read_text().strip() == "flag=x"


def test_a_poll_returns_at_its_timeout_while_a_command_runs_and_a_second_start_is_refused(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(ROOT)
    queue = tmp_path / "q.txt"
    queue.write_text(f"touch {tmp_path}/begun; sleep 30\n")
    qdir = tmp_path / "queue"
    pid = start(queue, qdir)
    try:
        t0 = time.monotonic()
        assert not poll(qdir, timeout_s=1.0, out=None)
        assert time.monotonic() - t0 < 10
        with pytest.raises(SystemExit, match="already running"):
            start(queue, qdir)
    finally:
        os.killpg(pid, signal.SIGTERM)  # the runner leads its own session: bash and sleep go with it


def test_a_poll_until_a_result_returns_when_that_file_lands_with_later_commands_still_running(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(ROOT)
    queue = tmp_path / "q.txt"
    queue.write_text('sleep 1; echo 1 > "$QUEUE_RESULTS/first.json"\nsleep 30\n')
    qdir = tmp_path / "queue"
    pid = start(queue, qdir)
    try:
        t0 = time.monotonic()
        assert not poll(qdir, timeout_s=25.0, out=None, until="first.json")
        assert time.monotonic() - t0 < 20 and (qdir / "results/first.json").exists()
    finally:
        os.killpg(pid, signal.SIGTERM)


def test_a_poll_keeps_a_long_logs_end_only(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    qdir = tmp_path / "queue"
    (tmp_path / "q.txt").write_text("head -c 3000000 /dev/zero | tr '\\0' x; echo; echo the-end\n")
    start(tmp_path / "q.txt", qdir)
    _wait_done(qdir)
    poll(qdir, timeout_s=0.0, out=tmp_path / "out")
    with tarfile.open(tmp_path / "out" / "queue.tar.gz") as tar:
        log = tar.extractfile("00.log").read()
    assert len(log) == 2 << 20 and log.endswith(b"the-end\n")


def _bundle(root: Path, data: bytes, cuts: list[int]) -> Path:
    """A bundle as ../shared/tools/gpu-vllm-bundle leaves it: parts p1, p2, ... of `data`, SHA256 last."""
    bundle = root / ".gpu"
    bounds = [0, *cuts, len(data)]
    for n, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
        (bundle / f"p{n}").mkdir(parents=True)
        (bundle / f"p{n}" / f"part{n - 1:02d}").write_bytes(data[a:b])
    last = bundle / f"p{len(bounds) - 1}"
    (last / "SHA256").write_text(hashlib.sha256(data).hexdigest() + "\n")
    (last / "install-on-device.sh").write_text("#!/usr/bin/env bash\n")
    return bundle


def test_the_bundle_is_cut_again_so_that_every_call_fits_beside_the_tree(tmp_path):
    mib = 1 << 20
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "README.md").write_bytes(b"x" * (mib // 2))  # the tree that travels with every call
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "a.whl").write_bytes(b"w" * (mib // 2))  # with the last part
    (tmp_path / ".gitignore").write_text("/.gpu/\n/.whl/\n")
    data = os.urandom(5 * mib + 123)
    bundle = _bundle(tmp_path, data, [int(3.5 * mib)])  # 3.5 MiB + the tree: more than a 3 MiB call
    dirs = fit_bundle(bundle, tmp_path, budget_mib=3)
    assert [d.name for d in dirs] == [f"p{n}" for n in range(1, len(dirs) + 1)]
    joined = b"".join((d / f"part{n:02d}").read_bytes() for n, d in enumerate(dirs))
    assert joined == data  # what install-on-device.sh assembles and checks
    for d in dirs:
        carried = sum(f.stat().st_size for f in d.iterdir()) + (mib // 2 if d == dirs[-1] else 0)
        assert carried + mib // 2 < 3 * mib
    assert {f.name for f in dirs[-1].iterdir()} >= {"SHA256", "install-on-device.sh"}
    (dirs[0] / "part00").write_bytes(b"damaged")
    with pytest.raises(SystemExit, match="do not join"):
        fit_bundle(bundle, tmp_path, budget_mib=3)


def test_a_missing_or_exhausted_queue_file_is_named(tmp_path):
    with pytest.raises(SystemExit, match="no such queue file"):
        start(tmp_path / "missing.txt", tmp_path / "q")
    (tmp_path / "one.txt").write_text("true\n")
    with pytest.raises(SystemExit, match="no commands after the first 1"):
        start(tmp_path / "one.txt", tmp_path / "q", skip=1)


def test_poll_without_a_queue_says_how_to_start_one(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "bench.device_queue", "poll", "0", "--dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode != 0 and "device_queue start" in result.stderr


def _expand(command: str, env: dict[str, str]) -> str:
    """$NAME and ${NAME:-default} as bash expands them, from `env` (unset: empty, or the default)."""
    command = re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: env.get(m.group(1)) or m.group(2), command)
    return re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), ""), command)


def _bench_invocations(queue: Path) -> list[tuple[str, list[str]]]:
    """(bench module, its argv) of every bench command in a committed queue; a command's `||`, `&&`, `;` and
    braces end a bench's argv."""
    env = {"QUEUE_RESULTS": "/results", "QUEUE_DIR": "/queue"}
    found = []
    for command in parse_queue(queue.read_text()):
        lexer = shlex.shlex(_expand(command, env), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        argv = list(lexer)
        for at, word in enumerate(argv[:-1]):
            if word == "-m" and argv[at + 1].startswith("bench."):
                rest = argv[at + 2 :]
                end = next((i for i, w in enumerate(rest) if w in ("||", "&&", ";", "{", "}")), len(rest))
                found.append((argv[at + 1], rest[:end]))
    return found


@pytest.mark.parametrize("queue", QUEUES, ids=lambda p: p.name)
def test_every_bench_in_the_queue_parses_into_a_valid_gpu_configuration(queue):
    """What the queue runs on the GPU is checked here first: a typo must not cost device time."""
    import tyro

    import bench.e2e as e2e
    import bench.generator as generator
    import bench.learner_step as learner_step
    import bench.mps_check as mps_check
    import bench.mps_gemms as mps_gemms
    from deploy.plan import LaunchConfig
    from runtime.config import load_config

    invocations = _bench_invocations(queue)
    assert invocations and {m for m, _ in invocations} <= {
        "bench.e2e",
        "bench.generator",
        "bench.learner_step",
        "bench.mps_check",
        "bench.mps_gemms",
    }
    for module, argv in invocations:
        if module == "bench.mps_gemms":  # a gate: an earlier row's sweep and one of its settings
            path, setting = argv
            assert Path(path).parent == Path("/results") and setting in mps_gemms.settings("cuda")
        elif module == "bench.mps_check":
            cfg = tyro.cli(mps_check.Config, args=argv)
            assert cfg.device == "cuda" and cfg.out.parent == Path("/results")
        elif module == "bench.generator":
            cfg = tyro.cli(generator.GeneratorBench, args=argv)
            assert cfg.device == "cuda" and cfg.out.parent == Path("/results")
        elif module == "bench.e2e":
            cfg = tyro.cli(e2e.BenchConfig, args=argv)
            assert cfg.device == "cuda" and cfg.out.parent == Path("/results")
            for k in cfg.ks:
                argv = e2e.launcher_args(cfg, k, Path("/models/m"), Path("/runs/r"))
                launch = load_config(LaunchConfig, argv)
                assert launch.learner.batching.share_prompts
                assert launch.learner.algo.max_staleness == k
        else:
            cfg = tyro.cli(learner_step.BenchConfig, args=argv).resolve()
            for name in cfg.variants:
                overrides = learner_step.variant_overrides(name)
                lc = learner_step.learner_config(cfg, overrides, Path("m"), "zmq://127.0.0.1:1", Path("c"))
                lc.validate()
