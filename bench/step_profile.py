"""One call under torch.profiler, summarised for a benchmark's JSON row: where a step's time goes.

    python -m bench.learner_step --model 3b --reserve-frac 0.3 --profile-groups 16   # a profiled extra step

`profile_call(fn, device)` runs `fn()` once under torch.profiler (CPU and, on CUDA, kernel activity) and
returns fn's result with a summary:
  wall_s         the call's wall time (profiled: the profiler's own overhead is in it);
  gpu_busy_s     the summed self time of every kernel (0 on CPU): against wall_s, the share of the call the
                 GPU computed, so a step bound by kernel launches or host work shows up as a low share;
  gpu_busy_frac  gpu_busy_s / wall_s;
  host_syncs     how many times the host waited for the device (`.item()`, `.tolist()`, `int(tensor)`: the
                 `aten::_local_scalar_dense` calls, and explicit stream / device / event synchronizes);
  top            the `top` operators and kernels by self device time (by self CPU time on CPU): name,
                 calls, self device ms, self CPU ms.
No trace file is written: a training step's trace runs to hundreds of megabytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

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
    with profile(activities=activities) as prof:
        result = fn()
        if cuda:
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - t0
    return result, summarise(prof.key_averages(), wall, cuda, top)


def summarise(events, wall_s: float, cuda: bool, top: int = 25) -> dict:
    """The summary of `events` (a profiler's key_averages()) over a call of `wall_s` seconds."""
    rows = [
        {
            "name": e.key,
            "calls": int(e.count),
            "self_device_ms": _device_us(e) / 1e3,
            "self_cpu_ms": e.self_cpu_time_total / 1e3,
        }
        for e in events
    ]
    kernels_us = sum(_device_us(e) for e in events if _is_kernel(e))
    if (
        cuda and not kernels_us
    ):  # no device-side rows: each kernel's time is its launching operator's self time
        kernels_us = sum(_device_us(e) for e in events)
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
    summing only these counts each kernel once."""
    kind = getattr(event, "device_type", None)
    return kind is not None and getattr(kind, "name", str(kind)) == "CUDA"
