"""Host memory a process may still allocate, and a clear error when a plan needs more than that.

    need = 12 * n_params                       # e.g. fp32 master weights + AdamW moments in host memory
    check_host_memory(need, "the host-memory AdamW states", "use more GPUs (optim.master_weights=params)")

`available_bytes()` is the smaller of the kernel's MemAvailable (/proc/meminfo: free memory plus what the
page cache can give back) and, inside a container, the cgroup's limit less its usage other than page cache
(cgroup v2 memory.max, memory.current and memory.stat's `file`; v1 the same files' equivalents); None where
neither can be read (not Linux), and then nothing is checked. The page cache counts as free because a
refusal the kernel would not have made is worse than the OOM kill the check exists to forestall. A 7B
learner's host-memory AdamW needs ~100 GB: without the check, a machine that has less gets the kernel's OOM
killer minutes into the run, after vLLM has started and the first rollouts are generated.

Some virtual machines give memory as it is used (a balloon or hot-plugged memory, e.g. Firecracker VMs: on
one 2-GPU machine MemTotal read 31 GiB at the start of a 256 GiB machine and grew as memory was filled), so
MemAvailable under-reports what they can give. There, `PARALLAX_HOST_MEMORY_GIB`
states the machine's memory, and what is available is that less what is in use now (MemTotal - MemAvailable).
"""

from __future__ import annotations

import os
from pathlib import Path

MEMORY_ENV = "PARALLAX_HOST_MEMORY_GIB"
"""The host memory in GiB where the kernel's figure under-reports it (module docstring)."""

CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat", "file"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
        "total_cache",
    ),
)
"""(limit, usage, stat, the stat's page-cache key) of cgroup v2 and v1: the usage counts the page cache,
which the kernel gives back under pressure, so it does not count as used."""


def available_bytes(meminfo: str = "/proc/meminfo", cgroups=CGROUP_FILES, environ=os.environ) -> int | None:
    """Bytes this process may still allocate in host memory (module docstring); None if unknown."""
    found = []
    kernel = _meminfo(meminfo)
    stated = environ.get(MEMORY_ENV, "").strip()
    if stated:
        try:
            total = float(stated) * 2**30
        except ValueError:
            raise ValueError(f"{MEMORY_ENV}={stated!r}: give the machine's memory in GiB, e.g. 128") from None
        in_use = kernel["MemTotal"] - kernel["MemAvailable"] if len(kernel) == 2 else 0
        found.append(max(int(total) - in_use, 0))
    elif "MemAvailable" in kernel:
        found.append(kernel["MemAvailable"])
    for limit_file, usage_file, stat_file, cache_key in cgroups:
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" (v2) or a huge number (v1): no limit
            found.append(max(int(limit) - usage + _stat(stat_file, cache_key), 0))
        break
    return min(found) if found else None


def _meminfo(path: str) -> dict[str, int]:
    """MemTotal and MemAvailable in bytes, those that /proc/meminfo (or `path`) has."""
    found = {}
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                found[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found


def _stat(path: str, key: str) -> int:
    """One counter of a cgroup's memory.stat (0 if absent)."""
    try:
        for line in Path(path).read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def check_host_memory(need: int, what: str, fix: str, available: int | None = None) -> None:
    """Raise MemoryError naming `what`, the sizes and `fix` when `need` bytes exceed what is available."""
    available = available_bytes() if available is None else available
    if available is not None and need > available:
        raise MemoryError(
            f"{what} need {need / 1e9:.1f} GB of host memory, but this machine has {available / 1e9:.1f} GB "
            f"available: {fix} (a VM that gives memory as it is used under-reports it: set {MEMORY_ENV} to "
            "its memory in GiB)"
        )
