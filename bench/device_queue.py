"""Run a queue of bench commands on the lent GPU machine across several short device calls.

A device call lasts at most 10 minutes and the machine goes back about 30 s after a call returns, while one
session's GPU measurements take half an hour. So the first call starts the queue in the background and
returns at once; each following call (made at once after the previous one returns) polls it: it prints each
command's start and end, the tail of the running command's log, and packs the state, every log and the result
files into one archive in $OUT (a call brings back at most 8 files: a queue has more logs than that).

    python3 -m bench.device_queue start bench/queues/h200.txt --dir /tmp/queue     # returns at once
    python3 -m bench.device_queue poll 540 --dir /tmp/queue --out "$OUT"           # until done or 540 s
    python3 -m bench.device_queue poll 570 --until e2e_3b_k0.json --out "$OUT"     # or that result is in
    tar xzf <files_at>/queue.tar.gz -C /tmp/q      # here: state.json, NN.log, results/
    python3 -m bench.device_queue fit-bundle .gpu   # here, before a session: parts that fit beside the tree

A queue file holds one shell command per line (a trailing backslash continues a line; `#` starts a comment
line). The commands run one after the other in `bash -c`, from the directory `start` ran in, each whatever
the previous one returned, in the environment `start` ran in (export PYTHONPATH and the like before it).
Each sees `QUEUE_RESULTS` (write result files there: they come back with the logs) and `QUEUE_DIR`;
`$QUEUE_DIR/env` is sourced before each command, so a command can set a variable for the later ones by
appending `NAME=value` to it (session 15's queue: a failed GPU test switched the later runs to another
configuration). `state.json` records every command's exit status and times. Standard library only: it runs
on the device before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

TAIL_EVERY_S = 60.0
"""How often `poll` prints the tail of the running command's log."""
ARCHIVE = "queue.tar.gz"
"""What a poll writes into --out: the one file that carries everything back."""
LOG_BYTES = 2 << 20
"""A log's last bytes that go into the archive (a call brings back 16 MiB a file)."""
CALL_MIB = 64
"""What one device call carries at most: the working tree and the carried paths together."""


def parse_queue(text: str) -> list[str]:
    """The commands of a queue file: comment and blank lines dropped, backslash-continued lines joined."""
    commands, pending = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        commands.append(pending + line)
        pending = ""
    if pending:
        raise ValueError(f"the queue ends inside a continued line: {pending!r}")
    return commands


def start(queue_file: Path, qdir: Path, skip: int = 0) -> int:
    """Start the queue (less its first `skip` commands) in a detached process that outlives the device call;
    returns its pid."""
    if not queue_file.is_file():
        raise SystemExit(f"{queue_file}: no such queue file (run from the repository root)")
    commands = parse_queue(queue_file.read_text())[skip:]
    if not commands:
        raise SystemExit(f"{queue_file}: no commands" + (f" after the first {skip}" if skip else ""))
    if (qdir / "state.json").exists() and not _read_state(qdir)["done"]:
        raise SystemExit(f"{qdir}: a queue is already running there")
    if not skip:  # a new queue: nothing of an earlier one's variables or logs (`--skip` continues them)
        for path in [qdir / "env", *qdir.glob("[0-9][0-9].log")]:
            path.unlink(missing_ok=True)
    (qdir / "results").mkdir(parents=True, exist_ok=True)
    state = {"commands": commands, "first": skip, "steps": [], "done": False, "started": time.time()}
    _write_state(qdir, state)
    runner = subprocess.Popen(
        [sys.executable, "-m", "bench.device_queue", "run", "--dir", str(qdir)],
        stdin=subprocess.DEVNULL,
        stdout=open(qdir / "runner.log", "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    print(f"queue started: {len(commands)} commands, pid {runner.pid}, dir {qdir}")
    return runner.pid


def run(qdir: Path) -> None:
    """The detached runner: every command in turn, its output into NN.log, its status into state.json."""
    state = _read_state(qdir)
    env = {**os.environ, "QUEUE_DIR": str(qdir.resolve()), "QUEUE_RESULTS": str((qdir / "results").resolve())}
    for i, command in enumerate(state["commands"], start=state["first"]):  # numbered as in the queue file
        step = {"index": i, "command": command, "log": f"{i:02d}.log", "start": time.time(), "rc": None}
        state["steps"].append(step)
        _write_state(qdir, state)
        with open(qdir / step["log"], "wb") as log:
            script = f'if [ -f "$QUEUE_DIR/env" ]; then set -a; . "$QUEUE_DIR/env"; set +a; fi\n{command}'
            step["rc"] = subprocess.call(
                ["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT, env=env
            )
        step["end"] = time.time()
        _write_state(qdir, state)
    state["done"] = True
    _write_state(qdir, state)


def poll(qdir: Path, timeout_s: float, out: Path | None, until: str | None = None) -> bool:
    """Report until the queue is done, `timeout_s` passes or the result file `until` exists; copy what
    finished to `out`. True if done. A machine without the queue (a fresh one) fails at once."""
    deadline, seen, last_tail = time.monotonic() + timeout_s, set(), time.monotonic()
    while True:
        state = _read_state(qdir)
        arrived = until is not None and (qdir / "results" / until).exists()
        for step in state["steps"]:
            for event in ("start", "end"):
                if step.get(event) is not None and (step["index"], event) not in seen:
                    seen.add((step["index"], event))
                    print(_describe(step, event, state["started"]), flush=True)
        running = [s for s in state["steps"] if s["rc"] is None]
        if state["done"] or arrived or time.monotonic() >= deadline:
            break
        if running and time.monotonic() - last_tail >= TAIL_EVERY_S:
            print(_tail(qdir / running[0]["log"]), flush=True)
            last_tail = time.monotonic()
        time.sleep(min(2.0, max(deadline - time.monotonic(), 0.0)))
    if running:
        now = running[0]
        print(f"still running: [{now['index']}] {now['command']}\n{_tail(qdir / now['log'])}")
    left = len(state["commands"]) - sum(s["rc"] is not None for s in state["steps"])
    print(f"queue {'done' if state['done'] else 'running'}: {left} of {len(state['commands'])} commands left")
    if out is not None:
        _copy_back(qdir, out)
    return bool(state["done"])


def _describe(step: dict, event: str, t0: float) -> str:
    at = f"{(step[event] - t0) / 60:5.1f} min"
    if event == "start":
        return f"{at} start [{step['index']}] {step['command']}"
    return f"{at} end   [{step['index']}] rc={step['rc']} after {step['end'] - step['start']:.0f} s"


def _tail(log: Path, lines: int = 8) -> str:
    text = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join("    | " + line[-200:] for line in text[-lines:])


def _copy_back(qdir: Path, out: Path) -> None:
    """The state, the variables (`env`), every log (its last LOG_BYTES) and the results directory, as
    `out`/ARCHIVE."""
    out.mkdir(parents=True, exist_ok=True)
    logs = [qdir / "runner.log", *sorted(qdir.glob("[0-9][0-9].log"))]
    results = sorted(p for p in (qdir / "results").rglob("*") if p.is_file())
    with tarfile.open(out / ARCHIVE, "w:gz") as tar:
        for path in [qdir / "state.json", qdir / "env", *logs, *results]:
            if not path.exists():
                continue
            data = path.read_bytes()
            if path in logs:
                data = data[-LOG_BYTES:]
            info = tarfile.TarInfo(str(path.relative_to(qdir)))
            info.size, info.mtime = len(data), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(data))


def fit_bundle(bundle: Path, root: Path = Path("."), budget_mib: int = CALL_MIB) -> list[Path]:
    """Cut the vLLM bundle (../shared/tools/gpu-vllm-bundle's parts p1, p2, ...) again so that every call's
    part fits beside the working tree that travels with it; the last part (with SHA256 and the install
    script) shares its call with .whl/. The parts join into the same tar (the install script checks it)."""
    dirs = sorted(bundle.glob("p[0-9]*"), key=lambda d: int(d.name[1:]))
    if not dirs or not (dirs[-1] / "SHA256").is_file():
        raise SystemExit(
            f"{bundle}: no bundle there (build it with ../shared/tools/gpu-vllm-bundle {bundle})"
        )
    parts = sorted(
        (p for d in dirs for p in d.glob("part*")), key=lambda p: p.name
    )  # as the install joins them
    data = b"".join(p.read_bytes() for p in parts)
    if hashlib.sha256(data).hexdigest() != (dirs[-1] / "SHA256").read_text().split()[0]:
        raise SystemExit(f"{bundle}: the parts do not join into the bundle its SHA256 names")
    tree = _tree_bytes(root)
    wheels = sum(p.stat().st_size for p in (root / ".whl").glob("*.whl"))
    size = (budget_mib << 20) - tree - (1 << 20)  # a MiB to spare for files written before a call
    if size <= 0:
        raise SystemExit(
            f"the working tree alone ({tree / 2**20:.1f} MiB) leaves no room in {budget_mib} MiB"
        )
    last_room = size - wheels  # the last call carries .whl/ too
    if last_room <= 0:
        raise SystemExit(f".whl/ ({wheels / 2**20:.1f} MiB) leaves no room for a part in {budget_mib} MiB")
    n_head = -(-max(len(data) - last_room, 0) // size)
    chunks = [data[i : i + size] for i in range(0, n_head * size, size)] + [data[n_head * size :]]
    extras = {name: (dirs[-1] / name).read_bytes() for name in ("SHA256", "install-on-device.sh")}
    for d in dirs:
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    out = []
    for n, chunk in enumerate(chunks, start=1):
        d = bundle / f"p{n}"
        d.mkdir()
        (d / f"part{n - 1:02d}").write_bytes(chunk)
        out.append(d)
    for name, content in extras.items():
        (out[-1] / name).write_bytes(content)
    (out[-1] / "install-on-device.sh").chmod(0o755)
    for d in out:
        carried = sum(f.stat().st_size for f in d.iterdir()) + (wheels if d == out[-1] else 0)
        print(f"{d}: carries {carried / 2**20:.1f} MiB + the tree {tree / 2**20:.1f} MiB")
    return out


def _tree_bytes(root: Path) -> int:
    """The bytes of what travels with every call: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root, capture_output=True, check=True,
    ).stdout  # fmt: skip
    paths = {root / p for p in listed.decode().split("\0") if p}
    return sum(p.stat().st_size for p in paths if p.is_file())


def _read_state(qdir: Path) -> dict:
    path = qdir / "state.json"
    if not path.exists():
        raise SystemExit(
            f"{qdir}: no queue there (start one with `python3 -m bench.device_queue start FILE`)"
        )
    return json.loads(path.read_text())


def _write_state(qdir: Path, state: dict) -> None:
    """Atomically: a poll never reads half a file."""
    tmp = qdir / "state.json.tmp"
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(qdir / "state.json")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.device_queue", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    p_start = sub.add_parser("start", help="start a queue file's commands in the background")
    p_start.add_argument("queue", type=Path)
    p_start.add_argument(
        "--skip", type=int, default=0, help="leave out the first SKIP commands (done before)"
    )
    p_poll = sub.add_parser("poll", help="report until the queue is done or TIMEOUT_S passes")
    p_poll.add_argument("timeout_s", type=float)
    p_poll.add_argument("--out", type=Path, default=None, help="copy logs and results here (the call's $OUT)")
    p_poll.add_argument("--until", default=None, help="return as soon as this file is in the results")
    p_run = sub.add_parser("run", help="(internal) the detached runner")
    for p in (p_start, p_poll, p_run):
        p.add_argument("--dir", type=Path, default=Path("/tmp/queue"), help="the queue's working directory")
    p_fit = sub.add_parser(
        "fit-bundle", help="(here) cut the vLLM bundle into parts that fit beside the tree"
    )
    p_fit.add_argument("bundle", type=Path)
    args = parser.parse_args(argv)
    if args.action == "fit-bundle":
        fit_bundle(args.bundle)
    elif args.action == "start":
        start(args.queue, args.dir, args.skip)
    elif args.action == "poll":
        poll(args.dir, args.timeout_s, args.out, args.until)
    else:
        run(args.dir)


if __name__ == "__main__":
    main()
