"""One call under torch.profiler, summarised for a benchmark's JSON row: where a step's time goes.

    python -m bench.learner_step --model 3b --reserve-frac 0.3 --profile-groups 16   # a profiled extra step

`profile_call(fn, device)` runs `fn()` once under torch.profiler (CPU and, on CUDA, kernel activity) and
returns fn's result with a summary:
  wall_s         the call's wall time (profiled: the profiler's own overhead is in it);
  gpu_busy_s     the summed self time of every kernel (0 on CPU): against wall_s, the share of the call the
                 GPU computed, so a step bound by kernel launches or host work shows up as a low share;
  gpu_busy_frac  gpu_busy_s / wall_s;
  host_syncs     the host's waits for the device as the profiler records them: `aten::_local_scalar_dense`
                 (`.item()`, `int(tensor)`) and the CUDA runtime's stream / device / event synchronizes (an
                 `.item()` counts twice, as the operator and the stream synchronize it issues);
  top            the `top` operators and kernels by self device time (by self CPU time on CPU): name,
                 calls, self device ms, self CPU ms;
  sync_sites     (CUDA) where the host waited: torch's sync debug mode warns at every synchronizing operation
                 (`torch.cuda.set_sync_debug_mode`), and each warning is counted by its call site, the
                 innermost three frames of this repository or transformers ("forward.py:177 < ..."), most
                 frequent first; `syncs_flagged` is their total (explicit event waits are not flagged).
No trace file is written: a training step's trace runs to hundreds of megabytes.
"""

from __future__ import annotations

import collections
import contextlib
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

SYNC_KEYS = (
    "aten::_local_scalar_dense",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
)
"""Profiler event names that are the host waiting for the device."""


def profile_call(fn: Callable[[], Any], device: torch.device, top: int = 25) -> tuple[Any, dict]:
    """fn() under torch.profiler; returns (fn's result, the summary in the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with sync_sites(device) as sites, profile(activities=activities) as prof:
        result = fn()
        if cuda:
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    summary = summarise(prof.key_averages(), wall, cuda, top)
    if cuda:
        summary["syncs_flagged"] = sum(sites.values())
        summary["sync_sites"] = [{"site": k, "count": n} for k, n in sites.most_common(top)]
    return result, summary


@contextlib.contextmanager
def sync_sites(device: torch.device) -> Iterator[collections.Counter]:
    """Count the synchronizing CUDA operations run inside the block by call site (nothing on CPU)."""
    if device.type != "cuda":
        yield collections.Counter()
        return
    with recording("synchronizing") as counts:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def recording(text: str) -> Iterator[collections.Counter]:
    """Count the warnings whose message holds `text` by call site instead of printing them (others print)."""
    counts: collections.Counter = collections.Counter()
    with warnings.catch_warnings():  # restores the filters and showwarning on exit
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if text in str(message):
                counts[call_site()] += 1
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield counts


def call_site(depth: int = 3) -> str:
    """The innermost `depth` frames of this repository or transformers on the stack, innermost first."""
    frames = [
        f
        for f in traceback.extract_stack()
        if "site-packages/transformers/" in f.filename
        or (f.filename.startswith(str(ROOT)) and f.filename != __file__)
    ]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[::-1][:depth]) or "?"


def summarise(events, wall_s: float, cuda: bool, top: int = 25) -> dict:
    """The summary of `events` (a profiler's key_averages()) over a call of `wall_s` seconds."""
    rows = [
        {
            "name": e.key,
            "calls": int(e.count),
            "self_device_ms": _device_us(e) / 1e3,
            "self_cpu_ms": e.self_cpu_time_total / 1e3,
            "range": _is_range(e),  # a record_function span: its device time is not a kernel's
        }
        for e in events
    ]
    kernels_us = sum(_device_us(e) for e in events if _is_kernel(e))
    if cuda and not kernels_us:  # no device-side rows: a kernel's time is its launching operator's
        kernels_us = sum(_device_us(e) for e in events if not _is_range(e))
    order = "self_device_ms" if cuda else "self_cpu_ms"
    rows.sort(key=lambda r: r[order], reverse=True)
    return {
        "wall_s": wall_s,
        "gpu_busy_s": kernels_us / 1e6,
        "gpu_busy_frac": kernels_us / 1e6 / wall_s if wall_s > 0 else 0.0,
        "host_syncs": sum(int(e.count) for e in events if e.key in SYNC_KEYS),
        "top": rows[:top],
    }


def _device_us(event) -> float:
    """Self device time in microseconds (`self_device_time_total`; older torch: `self_cuda_time_total`)."""
    value = getattr(event, "self_device_time_total", None)
    if value is None:
        value = getattr(event, "self_cuda_time_total", 0.0)
    return float(value or 0.0)


def _is_kernel(event) -> bool:
    """A device-side event (a kernel or memcpy/memset) rather than a host operator that launched one:
    summing only these counts each kernel once. A `record_function` range (the optimizer's step, a compiled
    region) also has a device-side row, its span on the GPU: not a kernel, and it would count its kernels
    twice (an early summary counted the 2.9 s span of the optimizer's step as busy time)."""
    kind = getattr(event, "device_type", None)
    device = kind is not None and getattr(kind, "name", str(kind)) == "CUDA"
    return device and not _is_range(event)


def _is_range(event) -> bool:
    """A `record_function` range (torch's `is_user_annotation`), not an operator or a kernel."""
    return bool(getattr(event, "is_user_annotation", False))
