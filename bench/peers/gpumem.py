"""Run a command and record the GPU's peak memory in use while it ran, as the driver sees it.

    python -m bench.peers.gpumem --out PEAK.json -- python -m bench.peers.trl_grpo ...

The same measure for every system, whatever its processes and allocators (a vLLM engine's memory pool, a
learner in another process, CUDA MPS): NVML's used memory of GPU `--gpu`, sampled every `--every` seconds
from start to exit, minus nothing (the idle reading before the start is recorded beside it). Exits with the
command's status. Without NVML (a CPU machine) the command still runs and the file says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 2**30


class Sampler:
    """NVML used-memory readings of one GPU in a background thread; `peak` is the largest seen."""

    def __init__(self, gpu: int, every: float):
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(gpu)
        self.name = pynvml.nvmlDeviceGetName(self._handle)
        self.total = pynvml.nvmlDeviceGetMemoryInfo(self._handle).total
        self.idle = self.read()
        self.peak = self.idle
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def read(self) -> int:
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, self.read())

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())


def measure(command: list[str], gpu: int = 0, every: float = 0.25) -> tuple[int, dict]:
    """(the command's exit status, the record: peak and idle used GiB, the GPU's name and size)."""
    started = time.time()
    try:
        sampler = Sampler(gpu, every)
    except Exception as exc:  # noqa: BLE001 - no NVML (CPU machine, no driver): run without readings
        code = subprocess.call(command)
        return code, {"command": command, "nvml": f"unavailable: {exc}", "run_s": time.time() - started}
    with sampler:
        code = subprocess.call(command)
    record = {
        "command": command,
        "gpu": sampler.name,
        "gpu_total_gib": sampler.total / GIB,
        "idle_used_gib": sampler.idle / GIB,
        "peak_used_gib": sampler.peak / GIB,
        "exit_status": code,
        "run_s": time.time() - started,
    }
    return code, record


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        raise SystemExit("usage: python -m bench.peers.gpumem --out PEAK.json [--gpu N] -- COMMAND ...")
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m bench.peers.gpumem", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--every", type=float, default=0.25, help="seconds between readings")
    args = parser.parse_args(argv[:split])
    code, record = measure(argv[split + 1 :], args.gpu, args.every)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
