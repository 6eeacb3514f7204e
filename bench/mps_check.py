"""Which of the generator's kernels go wrong under a cap on the GPU's multiprocessors: each operation vLLM's
decode step runs, on the device in its dtype, against the same operation in fp32 on the CPU.

    python -m bench.mps_check --device cuda --out bench/results/mps_check.json
    python -m deploy.gpus.mps --mps-generator-sms 40 --timeout-s 180 --run-dir /tmp/mps-check -- \\
        python -m bench.mps_check --device cuda --out /tmp/mps_check_40.json

Why: under CUDA MPS with the generator capped at 40 % of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE) vLLM
returns a non-finite logprob in every sample, eager and under every attention backend tried
(docs/benchmarks.md, known limits). The CPU reference does not depend on MPS, so one run under the cap
names the operations that break there: torch's (cuBLAS GEMMs at decode, prefill and lm_head shapes, the
log-softmax, SDPA) and, where vLLM imports, vLLM's own (RMSNorm, SiLU x up, the sampler's logprob kernel).
Rows: operation, shape, whether every output is finite, the largest error over the reference's largest
magnitude, and ok (finite and within the dtype's tolerance). Then the launcher's own start-time check
(deploy/gpus/cap_check.py: each projection at 1, 64, 256 and 4096 rows into a NaN-filled output),
whose failures the JSON's `cap_check` lists: at 45 % on an H100 the sweep below passed and that check did
not (2026-12-07).
The JSON also records the cap in the environment and the multiprocessor count torch reports under it.
On an H100 at 40 % (2026-12-06): three of the four bf16 GEMMs wrong, everything else right; the GEMM sweep
that follows the rows (bench/mps_gemms.py) looks for why and for a BLAS setting that stays right.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

from bench.common import Device, check_device, table, write_result
from bench.mps_gemms import gemm_sweep

SHAPES = {
    "qwen2.5-vl-7b": {
        "seqs": 355,
        "prefill": 4096,
        "hidden": 3584,
        "ffn": 18944,
        "vocab": 152064,
        "heads": 28,
        "kv_heads": 4,
    },
    "tiny": {"seqs": 5, "prefill": 64, "hidden": 64, "ffn": 128, "vocab": 512, "heads": 4, "kv_heads": 2},
}
"""Operand sizes: a 7B decode step at the 7B end to end's 355 sequences at once, and a tiny set for tests."""

TOLERANCE = {"bfloat16": 2e-2, "float16": 1e-2, "float32": 1e-4}
"""Largest error over the reference's largest magnitude that counts as agreeing, by the device dtype."""


@dataclass
class Config:
    device: Device = "cuda"
    """Where the operations run (the reference always runs in fp32 on the CPU)."""
    shapes: Literal["qwen2.5-vl-7b", "tiny"] = "qwen2.5-vl-7b"
    """Operand sizes (SHAPES)."""
    out: Path = Path("bench/results/mps_check.json")
    """Where the JSON result goes."""
    gemm_sweep: bool = True
    """Then each GEMM shape under each BLAS setting into a NaN-filled output (bench/mps_gemms.py)."""


def compare(out, ref, dtype: str) -> dict:
    """finite, relative error and ok for one operation's device output against its fp32 CPU reference."""
    import torch

    out = out.detach().float().cpu()
    finite = bool(torch.isfinite(out).all())
    scale = ref.abs().max().item() or 1.0
    error = (out - ref).abs().max().item() / scale if finite else float("nan")
    return {"finite": finite, "rel_error": error, "ok": finite and error <= TOLERANCE[dtype]}


def torch_operations(s: dict) -> dict[str, tuple[str, list, Callable]]:
    """name -> (dtype, fp32 CPU inputs, fn(*inputs)) for torch's own kernels."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    h, f, v, n, p = s["hidden"], s["ffn"], s["vocab"], s["seqs"], s["prefill"]
    head = h // s["heads"]
    w = randn(h, f, scale=h**-0.5)
    return {
        f"matmul decode {n}x{h}x{f}": ("bfloat16", [randn(n, h), w], torch.matmul),
        f"matmul one row 1x{h}x{f}": ("bfloat16", [randn(1, h), w], torch.matmul),
        f"matmul prefill {p}x{h}x{f}": ("bfloat16", [randn(p, h), w], torch.matmul),
        f"lm_head {n}x{h}x{v}": ("bfloat16", [randn(n, h), randn(v, h, scale=h**-0.5)], F.linear),
        f"log_softmax {n}x{v}": ("float32", [randn(n, v, scale=4.0)], lambda x: torch.log_softmax(x, -1)),
        f"sdpa causal {s['heads']}x{p}x{head}": (
            "bfloat16",
            [randn(1, s["heads"], p, head) for _ in range(3)],
            lambda q, k, v_: F.scaled_dot_product_attention(q, k, v_, is_causal=True),
        ),
    }


def vllm_operations(s: dict) -> dict[str, tuple[str, list, Callable, Callable]]:
    """name -> (dtype, fp32 CPU inputs, vLLM's fn, the torch reference fn) for vLLM's own kernels ({} where
    vLLM does not import)."""
    try:
        import torch
        import torch.nn.functional as F
        from vllm import _custom_ops as ops
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs
    except Exception:  # noqa: BLE001 - any import failure means: no vLLM rows
        return {}
    g = torch.Generator().manual_seed(1)
    h, f, v, n = s["hidden"], s["ffn"], s["vocab"], s["seqs"]

    def rms_norm(x, w):
        out = torch.empty_like(x)
        ops.rms_norm(out, x, w, 1e-6)
        return out

    def silu_and_mul(x):
        out = x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        torch.ops._C.silu_and_mul(out, x)
        return out

    def rms_ref(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def token_logprobs_ref(logits, ids):
        return torch.log_softmax(logits, -1).gather(-1, ids.long())

    ids = torch.randint(0, v, (n, 1), generator=g)
    return {
        f"vllm rms_norm {n}x{h}": (
            "bfloat16",
            [torch.randn(n, h, generator=g), torch.rand(h, generator=g)],
            rms_norm,
            rms_ref,
        ),
        f"vllm silu_and_mul {n}x{2 * f}": (
            "bfloat16",
            [torch.randn(n, 2 * f, generator=g)],
            silu_and_mul,
            lambda x: F.silu(x[..., :f]) * x[..., f:],
        ),
        f"vllm token logprobs {n}x{v}": (
            "float32",
            [torch.randn(n, v, generator=g) * 4, ids],
            compute_token_logprobs,
            token_logprobs_ref,
        ),
    }


def run_one(name, dtype, inputs, fn, ref_fn, device) -> dict:
    """One row: `fn` on the device (floating inputs cast to `dtype`) against `ref_fn` in fp32 on the CPU."""
    import torch

    ref = ref_fn(*inputs)
    cast = [x.to(device, getattr(torch, dtype)) if x.is_floating_point() else x.to(device) for x in inputs]
    try:
        row = compare(fn(*cast), ref, dtype)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run here is a row, not the end of the check
        row = {"finite": None, "rel_error": None, "ok": None, "error": f"{type(e).__name__}: {e}"[:200]}
    return {"operation": name, "dtype": dtype, **row}


def model_config(s: dict) -> dict:
    """`s` as the config.json sizes deploy/gpus/cap_check.py reads its GEMM shapes from."""
    return {
        "hidden_size": s["hidden"],
        "intermediate_size": s["ffn"],
        "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"],
        "vocab_size": s["vocab"],
    }


def main(argv: list[str] | None = None) -> int:
    cfg = tyro.cli(Config, args=argv, description=__doc__)
    device = check_device(cfg.device)
    import torch

    from deploy.gpus.cap_check import check as cap_check

    shapes = SHAPES[cfg.shapes]
    rows = [run_one(n, d, x, fn, fn, device) for n, (d, x, fn) in torch_operations(shapes).items()]
    rows += [run_one(n, d, x, fn, ref, device) for n, (d, x, fn, ref) in vllm_operations(shapes).items()]
    unwritten = cap_check(model_config(shapes), device)
    sweep = gemm_sweep(shapes, device) if cfg.gemm_sweep else []
    cap = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "")
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else None
    where = f"on {device} vs fp32 on the CPU (MPS cap: {cap or 'none'}, SMs seen: {sms})"
    print(table(f"operations {where}", ["operation", "dtype", "finite", "rel_error", "ok", "error"], rows))
    print(
        f"the launcher's GEMM check (deploy/gpus/cap_check.py) {where}: "
        + ("\n  ".join(["", *unwritten]) or "ok")
    )
    if sweep:
        columns = ["operation", "setting", "dtype", "unwritten", "rel_error", "ok", "repeat_ok", "error"]
        print(table(f"GEMMs into NaN-filled outputs {where}", columns, sweep))
    write_result(
        {
            "config": {"device": device, "shapes": cfg.shapes, "gemm_sweep": cfg.gemm_sweep},
            "mps_cap": cap,
            "sms_seen": sms,
            "results": rows,
            "cap_check": unwritten,
            "gemm_sweep": sweep,
        },
        cfg.out,
    )
    return 0 if all(r["ok"] is not False for r in rows + sweep) and not unwritten else 1


if __name__ == "__main__":
    sys.exit(main())
