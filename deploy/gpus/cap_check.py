"""Whether the GPU writes every output of the model's bf16 GEMMs under the generator's MPS cap: the launcher
runs this under the generator's environment, before vLLM starts, whenever --mps-generator-sms caps it.

    python -m deploy.gpus.cap_check --model DIR       # exit 0: every output written; 1: names the GEMMs
    python -m deploy.gpus.mps --mps-generator-sms 40 -- python -m deploy.gpus.cap_check --model DIR  # by hand

Why: under CUDA MPS at 40 % of an H100's SMs, cuBLAS's bf16 GEMMs left 1-67 % of their outputs unwritten
(docs/benchmarks.md, 2026-12-06) and vLLM's behaviour logprobs went NaN minutes into the run; at 50 % every
GEMM checked was right. Here each projection of the model's decoder (its config.json: QKV with its bias, the
attention output, gate and up, down, lm_head) at 1, 64, 256 and 4096 rows writes into an output filled with
NaN, and what stays NaN was never written, so a cap that breaks GEMMs on this GPU stops the run at its start
with the GEMMs named. These shapes are a sample, not every GEMM vLLM will run: the generator's own stop on a
non-finite logprob stays. `python -m bench.mps_check` under the cap is the full diagnosis (every operation
against fp32 on the CPU, every BLAS setting, the kernels' names).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROWS = (1, 64, 256, 4096)
"""Rows per GEMM: one sequence decoding, small and full decode batches, a prefill chunk."""


def projections(config: dict) -> dict[str, tuple[int, int, bool]]:
    """name -> (in_features, out_features, with a bias) of the decoder's GEMMs, from a config.json (Qwen2.5-VL
    keeps the sizes at its top level, Qwen3-VL in text_config); ValueError naming what is missing."""
    text = config.get("text_config") or {}

    def size(key: str) -> int:
        value = text.get(key, config.get(key))
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"config.json gives no positive {key}")
        return value

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    kv_heads = text.get("num_key_value_heads", config.get("num_key_value_heads")) or heads
    head_dim = text.get("head_dim", config.get("head_dim")) or hidden // heads
    return {
        "qkv+bias": (hidden, (heads + 2 * kv_heads) * head_dim, True),
        "attention out": (heads * head_dim, hidden, False),
        "gate+up": (hidden, 2 * size("intermediate_size"), False),
        "down": (size("intermediate_size"), hidden, False),
        "lm_head": (hidden, size("vocab_size"), False),
    }


def gemm_into_nan(x, w, bias):
    """`x @ w.T` (+ `bias`: as addmm, the way vLLM's QKV projection runs) into an output filled with NaN
    before the call: whatever the kernel never wrote stays NaN."""
    import torch

    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device=x.device, dtype=x.dtype)
    if bias is not None:
        return torch.addmm(bias, x, w.t(), out=out)
    return torch.mm(x, w.t(), out=out)


def unwritten(out) -> float:
    """The share of `gemm_into_nan`'s output still NaN."""
    return out.isnan().sum().item() / out.numel()


def check(config: dict, device: str) -> list[str]:
    """One line per GEMM that left outputs unwritten on `device` ([] when every output was written)."""
    import torch

    torch.manual_seed(0)
    failed = []
    for name, (k, n, with_bias) in projections(config).items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
        bias = torch.zeros(n, device=device, dtype=torch.bfloat16) if with_bias else None
        for rows in ROWS:
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            share = unwritten(gemm_into_nan(x, w, bias))
            if share > 0:
                failed.append(f"{name} {rows}x{k}x{n}: {100 * share:.1f} % of its output unwritten")
        del w, bias
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.gpus.cap_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--model", type=Path, required=True, help="the checkpoint directory (its config.json)"
    )
    parser.add_argument("--device", default="cuda", help="cuda (the GPU this process sees) or cpu")
    args = parser.parse_args(argv)
    try:
        config = json.loads((args.model / "config.json").read_text())
        projections(config)
    except (OSError, ValueError) as e:
        print(
            f"deploy.gpus.cap_check: cannot read the model's GEMM shapes from {args.model}: {e}",
            file=sys.stderr,
        )
        return 2
    cap = os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "none")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        print(
            "deploy.gpus.cap_check: --device cuda, but this process sees no GPU "
            f"(CUDA_VISIBLE_DEVICES={visible}, MPS cap {cap} %)",
            file=sys.stderr,
        )
        return 2
    failed = check(config, args.device)
    if failed:
        print(
            f"deploy.gpus.cap_check: under this MPS cap ({cap} % of the SMs) the GPU left GEMM outputs "
            "unwritten, so vLLM would compute wrong logprobs:\n  " + "\n  ".join(failed) + "\n"
            "Raise --mps-generator-sms (50 held on an H100: docs/benchmarks.md) or drop it.",
            file=sys.stderr,
        )
        return 1
    print(f"deploy.gpus.cap_check: every GEMM output written under the MPS cap ({cap} %), {args.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
