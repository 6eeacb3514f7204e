"""CUDA MPS on a shared GPU: the learner's and the generator's kernels run side by side.

    python -m deploy --learner.gpus 0 --generator.gpus 0 --mps ...
    python -m deploy.gpus.mps --mps-generator-sms 40 --timeout-s 360 -- COMMAND...  # alone, as the generator

Without MPS, CUDA gives the GPU to one process at a time (time slices): with K >= 1 the learner and the
generator both have work, but only one of them runs at any moment, so the asynchronous pipeline overlaps
little more than each one's idle gaps (host-memory AdamW, packing, scheduling). Under NVIDIA's
Multi-Process Service both processes are clients of one MPS server and their kernels share the
multiprocessors, the way a compute-bound training step and memory-bound decoding can.

With `--mps` the launcher starts the MPS control daemon (`nvidia-cuda-mps-control -f`, installed with the
driver) before the roles and gives every role its pipe and log directories (CUDA_MPS_PIPE_DIRECTORY,
CUDA_MPS_LOG_DIRECTORY). The daemon runs without CUDA_VISIBLE_DEVICES: an MPS client numbers GPUs among the
server's, so each role keeps the driver index the plan gave it (the shared GPU). The pipe directory is a short
path under /tmp (the daemon's Unix sockets must fit 108 bytes), the log directory is `<run_dir>/mps/`. At the
end the daemon gets `quit` after the roles have stopped. A client that cannot reach the daemon silently runs
without MPS (the driver's rule), so the launcher waits for the daemon's control socket before it starts
anything that uses the GPU. `--mps-generator-sms P` caps the generator's kernels at P % of the multiprocessors
(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in its environment only), so the learner's compute-bound kernels are never
crowded off the GPU by memory-bound decoding; at 40 % vLLM's behaviour logprobs all came back NaN on an H100,
beside the learner (docs/benchmarks.md, 2026-12-05) and with vLLM alone under the daemon (2026-12-06), eager
and under other attention backends too (2026-12-06), because three of four bf16 cuBLAS GEMMs come back
wrong under the cap: they leave tiles of their output unwritten, under every BLAS setting (2026-12-06:
`python -m bench.mps_check` under the cap tests the operations one by one and sweeps the GEMMs over BLAS
settings), and the generator stops with that error. At 50 % every GEMM it checks is right and the 7B ran so
capped beside the learner (2026-12-06), so the cap is usable there, opt-in. Under a cap the launcher first
runs deploy/gpus/cap_check.py on the generator's GPU with its settings: a cap that leaves the model's GEMM
outputs unwritten ends the run at its start, naming them.
`--mps-generator-priority below-normal` instead lowers the generator's MPS client priority
(CUDA_MPS_CLIENT_PRIORITY=1 in its environment only): the learner's kernels are scheduled first and decoding
fills the multiprocessors they leave, with no cap (1.00x at 3B K = 1 on an H100, 2026-12-06: the step is the
learner's either way). CUDA-IPC weight sync and vLLM's start-up memory check work under MPS (an H100,
docs/benchmarks.md, 2026-12-05).

`python -m deploy.gpus.mps` runs one command under this daemon with the generator's cap and priority, and
nothing beside it: what diagnoses vLLM under MPS without the learner
(`python -m bench.mps_check`, `bench.generator`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.gpus.indices import LayoutError
from deploy.gpus.layout import GpuPlan
from deploy.processes import ChildDied, ProcessGroup

CONTROL = "nvidia-cuda-mps-control"
PRIORITY = {"normal": "0", "below-normal": "1"}
"""--mps-generator-priority -> CUDA_MPS_CLIENT_PRIORITY (NVIDIA's MPS guide, "Environment Variables")."""


@dataclass(frozen=True)
class GeneratorShare:
    """The generator's own settings under MPS (LaunchConfig's `mps_generator_*` fields, bench.e2e's rows),
    set in its environment only; the defaults set nothing (the driver's own choices)."""

    sms: int = 100
    """Its kernels' cap, in percent of the GPU's multiprocessors (100: none)."""
    priority: str = "normal"
    """Its MPS client priority: a key of PRIORITY."""

    @classmethod
    def of(cls, cfg: object) -> GeneratorShare:
        """From a config with `mps_generator_sms` and `mps_generator_priority`."""
        return cls(cfg.mps_generator_sms, cfg.mps_generator_priority)

    @classmethod
    def of_row(cls, row: dict) -> GeneratorShare:
        """From a bench row's `mps_generator_*` fields (older rows lack some: the defaults)."""
        default = cls()
        return cls(
            row.get("mps_generator_sms", default.sms),
            row.get("mps_generator_priority", default.priority),
        )

    def check(self, enabled: bool) -> None:
        """A LayoutError for a cap outside 1-100, an unknown priority, or either without --mps."""
        if not 1 <= self.sms <= 100:
            raise LayoutError(
                f"--mps-generator-sms is a percentage of the GPU's multiprocessors (1-100), not {self.sms}"
            )
        if self.priority not in PRIORITY:
            raise LayoutError(
                f"--mps-generator-priority is one of {', '.join(PRIORITY)}, not {self.priority!r}"
            )
        if enabled:
            return
        if self.sms < 100:
            raise LayoutError(
                f"--mps-generator-sms {self.sms} caps the generator's share of the GPU under MPS: add --mps"
            )
        if self.priority != "normal":
            raise LayoutError(
                f"--mps-generator-priority {self.priority} ranks the generator's work under MPS: add --mps"
            )

    def env(self) -> dict[str, str]:
        """The generator's environment for these settings ({} for the defaults)."""
        env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(self.sms)} if self.sms < 100 else {}
        if self.priority != "normal":
            env["CUDA_MPS_CLIENT_PRIORITY"] = PRIORITY[self.priority]
        return env

    def label(self) -> str:
        """For run directories and table lines: "40" for a cap, "-low" for below-normal priority, joined in
        that order ("" for the defaults)."""
        cap = str(self.sms) if self.sms < 100 else ""
        return cap + ("-low" if self.priority != "normal" else "")


def check_layout(enabled: bool, gpus: GpuPlan, share: GeneratorShare = GeneratorShare()) -> None:
    """--mps is for one GPU shared by the learner and the generator; elsewhere it is an error, as are the
    generator's settings where `share.check` refuses them."""
    if enabled and gpus.kind != "shared":
        raise LayoutError(
            f"--mps lets the learner and the generator share one GPU, but this layout is {gpus.kind}: "
            "use it with --learner.gpus 0 --generator.gpus 0, or drop --mps"
        )
    share.check(enabled)


def time_slice_notice(enabled: bool, gpus: GpuPlan, max_staleness: int) -> str:
    """What a K >= 1 run on one shared GPU without --mps should know ("" otherwise): its roles take turns on
    the GPU, so the asynchrony it asked for overlaps only where one of them leaves the GPU idle."""
    if enabled or gpus.kind != "shared" or max_staleness < 1:
        return ""
    return (
        f"K = {max_staleness} on one shared GPU without --mps: the learner and vLLM take turns on it (time "
        "slices) and overlap only where one leaves it idle; --mps lets their kernels run together "
        "(docs/gpu-layouts.md has what it gave)"
    )


class MpsDaemon:
    """The run's MPS control daemon: `start` it in a process group, hand `env` to the roles, `stop` it."""

    def __init__(self, run_dir: Path, control: str = CONTROL):
        self.control = control
        self.pipe_dir = Path(tempfile.mkdtemp(prefix="parallax-mps-"))
        self.log_dir = run_dir / "mps"
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
        }
        self.binary = ""

    def start(self, group: ProcessGroup, timeout_s: float = 20.0) -> dict[str, str]:
        """Start the daemon (after check_layout), wait for its control socket; returns the roles' env."""
        self.binary = shutil.which(self.control) or ""
        if not self.binary:
            raise LayoutError(
                f"--mps needs NVIDIA's MPS control daemon ({self.control}, installed with the driver) on "
                "PATH; install the driver's utilities or drop --mps (the GPU is then shared in time slices)"
            )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Clients number GPUs among those the server sees: the daemon sees the driver's whole list, so each
        # role's CUDA_VISIBLE_DEVICES (the plan's driver index) means the same GPU under MPS as without it.
        argv = ["env", "-u", "CUDA_VISIBLE_DEVICES", self.binary, "-f"]
        child = group.start("mps", argv, env=self.env)
        deadline = time.monotonic() + timeout_s
        while not (self.pipe_dir / "control").exists():
            if child.popen.poll() is not None:
                raise ChildDied(
                    f"the MPS control daemon exited ({child.popen.returncode}); see {child.log_path}"
                )
            if time.monotonic() > deadline:
                raise ChildDied(f"the MPS control daemon opened no control socket in {timeout_s:.0f} s")
            time.sleep(0.1)
        return dict(self.env)

    def stop(self) -> None:
        """Ask the daemon to quit (its server goes with it); the process group then stops what is left."""
        if self.binary:
            env = {**os.environ, **self.env}
            try:
                subprocess.run(
                    [self.binary], input=b"quit\n", env=env, timeout=10, check=False, capture_output=True
                )
            except (OSError, subprocess.TimeoutExpired):
                pass  # the process group's signals stop it
            self.binary = ""
        shutil.rmtree(self.pipe_dir, ignore_errors=True)


def run_alone(
    command: list[str], run_dir: Path, share: GeneratorShare = GeneratorShare(), timeout_s: float = 0.0
) -> int:
    """Run `command` under its own MPS daemon with the generator's settings (`share`), alone; its exit
    code, or 124 when it ran past `timeout_s` (> 0) and was killed with its process group. The daemon quits
    either way: a timeout here, not around this, is what leaves no daemon behind."""
    check_layout(True, GpuPlan("shared", "", "", (), "cuda-ipc"), share)
    with ProcessGroup(run_dir) as group:
        mps = MpsDaemon(run_dir)
        try:
            env = {**os.environ, **mps.start(group), **share.env()}
            child = subprocess.Popen(command, env=env, start_new_session=True)
            try:
                return child.wait(timeout=timeout_s or None)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                return 124
        finally:
            mps.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.gpus.mps",
        description="Run COMMAND alone under an MPS daemon, as the generator.",
    )
    parser.add_argument(
        "--mps-generator-sms", type=int, default=100, help="its SM cap in percent (100: none)"
    )
    parser.add_argument("--mps-generator-priority", default="normal", help="normal | below-normal")
    parser.add_argument(
        "--run-dir", type=Path, default=Path("runs/mps-alone"), help="logs: DIR/logs, DIR/mps"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=0.0, help="kill COMMAND after this long (0: never)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    try:
        return run_alone(command, args.run_dir, GeneratorShare.of(args), args.timeout_s)
    except (LayoutError, ChildDied) as e:
        print(f"deploy.gpus.mps: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
