"""bench/step_profile.py: the profiled call's summary counts host syncs and ranks operators."""

from types import SimpleNamespace

import torch

from bench.step_profile import profile_call, summarise


def test_profile_call_counts_host_syncs_and_ranks_operators():
    a = torch.randn(128, 128)

    def step() -> float:
        b = a @ a
        return sum(float(b[i].sum().item()) for i in range(3))

    result, summary = profile_call(step, torch.device("cpu"), top=5)
    assert isinstance(result, float)
    assert summary["host_syncs"] >= 3  # three .item() calls
    assert summary["wall_s"] > 0 and summary["gpu_busy_s"] == 0.0
    names = [row["name"] for row in summary["top"]]
    assert len(names) == 5 and "aten::mm" in names


def _event(key, self_device_us, device, count=1, annotation=False):
    return SimpleNamespace(
        key=key,
        count=count,
        self_device_time_total=self_device_us,
        self_cpu_time_total=10.0,
        device_type=SimpleNamespace(name=device),
        is_user_annotation=annotation,
    )


def test_summarise_counts_each_kernel_once():
    events = [
        _event("aten::mm", 600.0, "CPU"),  # the operator: its launched kernel's time again
        _event("sm90_gemm_kernel", 600.0, "CUDA"),
        _event("cudaStreamSynchronize", 0.0, "CPU", count=4),
        _event("aten::_local_scalar_dense", 0.0, "CPU", count=2),
        _event("Optimizer.step#AdamW.step", 1500.0, "CUDA", annotation=True),  # a span around kernels
    ]
    summary = summarise(events, wall_s=0.002, cuda=True, top=2)
    assert summary["gpu_busy_s"] == 600e-6
    assert abs(summary["gpu_busy_frac"] - 0.3) < 1e-9
    assert summary["host_syncs"] == 6
    assert [row["self_device_ms"] for row in summary["top"]] == [1.5, 0.6]
    assert summary["top"][0]["range"] and not summary["top"][1]["range"]


def test_warnings_are_counted_by_their_call_site_and_others_still_shown(recwarn):
    import warnings

    from bench.step_profile import recording

    def synchronizing():
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

    with recording("synchronizing") as counts:
        for _ in range(3):
            synchronizing()
        synchronizing()
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert sum(counts.values()) == 4 and len(counts) == 2  # two lines call it
    site = max(counts, key=counts.get)
    assert counts[site] == 3 and site.startswith("test_step_profile.py:")
    assert [str(w.message) for w in recwarn] == ["something else"]
