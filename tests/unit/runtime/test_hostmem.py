"""runtime/hostmem.py: host memory from /proc/meminfo and the cgroup's limit, and the error a plan that needs
more gets (the host-memory AdamW refuses before allocating)."""

import pytest
import torch

import runtime.hostmem as hostmem


def _files(tmp_path, available_kb, limit=None, usage=0, version=2, cache=0):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available_kb} kB\n")
    cg = [tmp_path / f"{name}{version}" for name in ("limit", "usage", "stat")]
    key = "file" if version == 2 else "total_cache"
    if limit is not None:
        cg[0].write_text(f"{limit}\n")
        cg[1].write_text(f"{usage}\n")
        cg[2].write_text(f"anon 5\n{key} {cache}\nshmem 0\n")
    return str(meminfo), ((*map(str, cg), key),)


def test_available_is_the_smaller_of_the_kernels_and_the_cgroups(tmp_path):
    meminfo, cgroups = _files(tmp_path, 1000)  # no cgroup files: the kernel's figure
    assert hostmem.available_bytes(meminfo, cgroups) == 1000 * 1024
    meminfo, cgroups = _files(tmp_path, 1000, limit="max")  # cgroup v2 without a limit
    assert hostmem.available_bytes(meminfo, cgroups) == 1000 * 1024
    meminfo, cgroups = _files(tmp_path, 1000, limit=500_000, usage=200_000)  # a container's limit
    assert hostmem.available_bytes(meminfo, cgroups) == 300_000
    meminfo, cgroups = _files(tmp_path, 1000, limit=500_000, usage=200_000, cache=50_000)
    assert hostmem.available_bytes(meminfo, cgroups) == 350_000  # the page cache in the usage is not used
    meminfo, cgroups = _files(tmp_path, 1000, limit=500_000, usage=400_000, cache=100, version=1)
    assert hostmem.available_bytes(meminfo, cgroups) == 100_100
    meminfo, cgroups = _files(tmp_path, 1000, limit=1 << 62, usage=5, version=1)  # v1's "unlimited"
    assert hostmem.available_bytes(meminfo, cgroups) == 1000 * 1024
    assert hostmem.available_bytes(str(tmp_path / "none"), ()) is None


def test_a_machine_whose_memory_grows_as_it_is_used_states_it(tmp_path):
    """A Firecracker VM's MemTotal starts far below its memory: the stated GiB less what is in use counts."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {31 << 20} kB\nMemFree: 1 kB\nMemAvailable: {30 << 20} kB\n")
    assert hostmem.available_bytes(str(meminfo), (), environ={}) == 30 << 30  # the kernel's figure
    stated = {hostmem.MEMORY_ENV: "128"}
    assert hostmem.available_bytes(str(meminfo), (), environ=stated) == 127 << 30  # 1 GiB in use
    limit, usage, stat = (tmp_path / n for n in ("limit", "usage", "stat"))
    limit.write_text(f"{64 << 30}\n")
    usage.write_text("0\n")
    stat.write_text("file 0\n")
    cgroups = ((str(limit), str(usage), str(stat), "file"),)
    assert (
        hostmem.available_bytes(str(meminfo), cgroups, environ=stated) == 64 << 30
    )  # a container's cap holds
    with pytest.raises(ValueError, match="in GiB"):
        hostmem.available_bytes(str(meminfo), (), environ={hostmem.MEMORY_ENV: "128G"})


def test_a_plan_that_needs_more_host_memory_is_refused_by_name(monkeypatch):
    hostmem.check_host_memory(10, "x", "y", available=10)
    monkeypatch.setattr(hostmem, "available_bytes", lambda: None)
    hostmem.check_host_memory(1 << 60, "x", "y")  # unknown (not Linux): nothing is checked
    with pytest.raises(MemoryError, match=r"the states need 0.0 GB .* 0.0 GB available: buy memory .*GIB"):
        hostmem.check_host_memory(11, "the states", "buy memory", available=10)


def test_the_host_memory_adamw_refuses_before_allocating(monkeypatch):
    from learner.optim import MasterAdamW

    params = [torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16))]
    monkeypatch.setattr(hostmem, "available_bytes", lambda: 12 * 1000)
    MasterAdamW(params, location="host")  # exactly fits
    monkeypatch.setattr(hostmem, "available_bytes", lambda: 12 * 1000 - 1)
    with pytest.raises(MemoryError, match="master weights and AdamW moments in host memory"):
        MasterAdamW(params, location="host")
