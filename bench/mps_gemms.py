"""The GEMM sweep of bench/mps_check.py: each GEMM shape of a 7B decode step under each BLAS setting, to tell
why cuBLAS GEMMs go wrong under a cap on the GPU's multiprocessors and which setting, if any, keeps them
right.

    python -m bench.mps_check --device cuda --out /tmp/mps_check.json      # runs this sweep after its rows
    python -m deploy.gpus.mps --mps-generator-sms 40 --timeout-s 240 --run-dir /tmp/mps-check -- \\
        python -m bench.mps_check --device cuda --out /tmp/mps_check_40.json

Why: under CUDA MPS at 40 % of an H100's SMs, three of four bf16 GEMMs returned finite but wrong values
while the first one run was right (docs/benchmarks.md, 2026-12-06). Each row here writes into an output
filled with NaN, so `unwritten` (the share of outputs still NaN) tells a kernel that never wrote from one
that wrote wrong numbers; the shapes run in the reverse of mps_check's order, so a shape that is right here
but was wrong there points at the process's state, not the shape; `repeat_ok` is a second call of the same
GEMM, profiled for the names of the kernels it launched. Settings: torch's choice, cuBLAS or cuBLASLt
preferred (`preferred_blas_library`, which `TORCH_BLAS_PREFER_CUBLASLT=1` sets for a whole process such as
vLLM's), bf16 reductions in fp32, fp16, fp32 without TF32, and torch's choice on a CUDA green context of 40 %
of the SMs this process sees (`torch.cuda.green_contexts`: another way to hold a process to part of the GPU,
without MPS; its kernels are told of all the SMs, where MPS reports the cap).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path


def gemm_shapes(s: dict) -> dict[str, tuple[tuple[int, int], tuple[int, int], bool]]:
    """name -> ((m, k) input, (n, k) weight, with a bias) for the decode step's GEMMs, in the reverse of
    mps_check's order, plus the QKV projection with its bias (vLLM's Qwen2 runs it as addmm)."""
    h, f, v, n, p = s["hidden"], s["ffn"], s["vocab"], s["seqs"], s["prefill"]
    qkv = h + 2 * (h // s["heads"]) * s["kv_heads"]
    return {
        f"lm_head {n}x{h}x{v}": ((n, h), (v, h), False),
        f"prefill {p}x{h}x{f}": ((p, h), (f, h), False),
        f"one row 1x{h}x{f}": ((1, h), (f, h), False),
        f"decode {n}x{h}x{f}": ((n, h), (f, h), False),
        f"qkv+bias {n}x{h}x{qkv}": ((n, h), (qkv, h), True),
    }


def settings(device: str) -> dict[str, tuple[str, Callable]]:
    """name -> (dtype, context manager factory). The BLAS library choices exist only where torch has CUDA."""
    import torch

    @contextmanager
    def blas(library: str) -> Iterator[None]:
        before = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library(library)
        try:
            yield
        finally:
            torch.backends.cuda.preferred_blas_library(before)

    @contextmanager
    def flag(owner, name: str, value: bool) -> Iterator[None]:
        before = getattr(owner, name)
        setattr(owner, name, value)
        try:
            yield
        finally:
            setattr(owner, name, before)

    @contextmanager
    def green(fraction: float) -> Iterator[None]:
        from torch.cuda.green_contexts import GreenContext

        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        whole_groups = max(8, int(sms * fraction) // 8 * 8)  # Hopper hands SMs out in groups of 8
        context = GreenContext.create(whole_groups, torch.cuda.current_device())
        context.set_context()
        try:
            with torch.cuda.stream(context.Stream()):
                yield
            torch.cuda.synchronize()
        finally:
            context.pop_context()

    matmul = torch.backends.cuda.matmul
    chosen = {
        "default": ("bfloat16", nullcontext),
        "fp32 reductions": (
            "bfloat16",
            lambda: flag(matmul, "allow_bf16_reduced_precision_reduction", False),
        ),
        "fp16": ("float16", nullcontext),
        "fp32 no tf32": ("float32", lambda: flag(matmul, "allow_tf32", False)),
    }
    if device == "cuda":
        chosen["cublas"] = ("bfloat16", lambda: blas("cublas"))
        chosen["cublaslt"] = ("bfloat16", lambda: blas("cublaslt"))
        chosen["green context 40 %"] = ("bfloat16", lambda: green(0.4))
    return chosen


def kernel_names(fn: Callable) -> list[str] | str:
    """The device kernels `fn()` launches, by the profiler; its error's text where the profiler cannot run."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
        names = {e.name for e in prof.events() if str(e.device_type).endswith("CUDA")}
        return sorted(names)
    except Exception as e:  # noqa: BLE001 - no kernel names is a finding, not the end of the sweep
        return f"{type(e).__name__}: {e}"[:200]


def operands(shape: tuple) -> tuple[list, object]:
    """fp32 CPU inputs (x, weight, bias or None) for one GEMM shape and their fp32 CPU product."""
    import torch

    (m, k), (n, _), with_bias = shape
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * k**-0.5
    bias = torch.randn(n, generator=g) if with_bias else None
    return [x, w, bias], x @ w.T + (bias if with_bias else 0)


def gemm_row(name: str, inputs: list, ref, setting: str, dtype: str, scope: Callable, device: str) -> dict:
    """One GEMM into a NaN-filled output under one setting, against its fp32 CPU product `ref`."""
    import torch

    from bench.mps_check import compare
    from deploy.gpus.cap_check import gemm_into_nan, unwritten

    d = getattr(torch, dtype)
    xd, wd, bd = (t.to(device, d) if t is not None else None for t in inputs)
    row: dict = {"operation": f"gemm {name}", "setting": setting, "dtype": dtype}

    def call():
        return gemm_into_nan(xd, wd, bd)

    try:
        with scope():
            first = call()
            if device == "cuda":
                torch.cuda.synchronize()
            row |= compare(first, ref, dtype) | {"unwritten": round(unwritten(first), 4)}
            repeats: list = []
            row["kernels"] = kernel_names(lambda: repeats.append(call())) if device == "cuda" else []
            row["repeat_ok"] = compare(repeats[-1] if repeats else call(), ref, dtype)["ok"]
    except Exception as e:  # noqa: BLE001 - a setting that cannot run here is a row
        row |= {"ok": None, "error": f"{type(e).__name__}: {e}"[:200]}
    return row


def gemm_sweep(shapes: dict, device: str) -> list[dict]:
    """Every GEMM shape under every setting, shapes outermost (each shape's rows in a row), the green
    context's rows last: a context that does not pop cleanly must not be what other settings' rows measure."""
    chosen = settings(device)
    green = {k: v for k, v in chosen.items() if k.startswith("green")}
    cases = {name: operands(shape) for name, shape in gemm_shapes(shapes).items()}
    rows = []
    for group in ({k: v for k, v in chosen.items() if k not in green}, green):
        for name, (inputs, ref) in cases.items():
            for setting, (dtype, scope) in group.items():
                rows.append(gemm_row(name, inputs, ref, setting, dtype, scope, device))
    return rows


def holds(result: dict, setting: str) -> bool:
    """Whether `setting` ran every GEMM of a sweep right (and at least one); for "default" (the launcher's
    own setting) also whether the launcher's GEMM check, where the result has one, found every output
    written."""
    chosen = [r for r in result.get("gemm_sweep", []) if r["setting"] == setting]
    launcher_ok = setting != "default" or not result.get("cap_check")
    return bool(chosen) and all(r["ok"] and r.get("repeat_ok") for r in chosen) and launcher_ok


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.mps_gemms RESULT.json SETTING`: exit 0 where SETTING ran every GEMM of the sweep
    right, 1 where not: what gates a run under a cap on a setting, e.g. `python -m bench.mps_gemms
    mps_check.json default && python -m bench.e2e --mps --mps-generator-sms 50 ...`."""
    import json

    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2 or args[0] in ("-h", "--help"):
        print(main.__doc__)
        return 2
    path, setting = args
    ok = holds(json.loads(Path(path).read_text()), setting)
    print(f"{setting}: {'every GEMM right' if ok else 'not every GEMM right'} in {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
