"""Checks the launcher makes before it starts anything, and how it explains a failed start.

- `inspect_model(path)`: is it a Hugging Face Qwen2.5-VL (or Qwen3-VL) checkpoint (config.json, safetensors
  weights, tokenizer, image processor), and how many parameters does it have (read from the
  safetensors headers: nothing is loaded)?
- `visible_gpus()`: the GPUs this process may use, indexed as CUDA_VISIBLE_DEVICES numbers them
  (`nvidia-smi`, else torch in a child process: the launcher never initialises CUDA itself).
- `require_vllm()`: vLLM must be importable by the children on a GPU run.
- `explain_failure(log_text)`: the fix for a process that died in a known way (deploy/failures.py: vLLM
  out of memory, vLLM not installed, no CUDA device, disk full, broker out of memory, ...), or "".

Every problem is a `PreflightError` whose message names the fix; the launcher prints it and stops
whatever it had started.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from deploy.failures import classify
from deploy.gpus.estimate import DecoderShape
from deploy.gpus.indices import GpuInfo
from policy.presets import FAMILIES

BUILD_HINT = "python -m policy build --preset small --out DIR"


class PreflightError(RuntimeError):
    """A problem found before (or while) starting the run; the message names the fix."""


@dataclass(frozen=True)
class ModelInfo:
    """What the launcher needs to know about a checkpoint before starting it."""

    path: Path
    n_params: int
    """Parameters counted from the safetensors headers."""
    dtype: str
    """torch_dtype / dtype of config.json (what the checkpoint stores)."""
    shape: DecoderShape | None = None
    """The language model's layers and widths (config.json, or its text_config); None when it gives none."""


def inspect_model(path: str | Path) -> ModelInfo:
    """A Qwen2.5-VL / Qwen3-VL checkpoint's parameter count; PreflightError (naming the fix) otherwise."""
    path = Path(path).expanduser()
    fix = (
        f"pass --model a Hugging Face Qwen2.5-VL directory (e.g. `huggingface-cli download "
        f"Qwen/Qwen2.5-VL-7B-Instruct --local-dir DIR`) or build one with `{BUILD_HINT}`"
    )
    if not path.is_dir():
        raise PreflightError(f"--model {path} is not a directory: {fix}")
    config = path / "config.json"
    if not config.is_file():
        raise PreflightError(
            f"--model {path} has no config.json, so it is not a Hugging Face checkpoint: {fix}"
        )
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise PreflightError(f"{config} is not readable JSON ({exc}): {fix}") from None
    model_type = data.get("model_type")
    architectures = data.get("architectures") or []
    if model_type not in FAMILIES:
        raise PreflightError(
            f"--model {path} is a {model_type or 'untyped'} checkpoint "
            f"({', '.join(architectures) or 'no architectures'}), not Qwen2.5-VL or Qwen3-VL "
            f"(config.json model_type {' or '.join(FAMILIES)}): {fix}"
        )
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise PreflightError(
            f"--model {path} has no *.safetensors weights (vLLM and the learner read safetensors only): "
            f"convert it with `model.save_pretrained(DIR, safe_serialization=True)` or {fix}"
        )
    missing = [
        name
        for name, options in (
            ("tokenizer", ("tokenizer.json", "tokenizer_config.json")),
            ("image processor", ("preprocessor_config.json", "processor_config.json")),
        )
        if not any((path / o).is_file() for o in options)
    ]
    if missing:
        raise PreflightError(
            f"--model {path} has no {' and no '.join(missing)} files: copy them from the checkpoint it "
            f"was trained from (`AutoProcessor.from_pretrained(BASE).save_pretrained(DIR)`) or {fix}"
        )
    n_params = sum(_safetensors_numel(s) for s in shards)
    text = data.get("text_config") or {}
    dtype = str(data.get("torch_dtype") or data.get("dtype") or text.get("dtype") or "")
    return ModelInfo(path=path.resolve(), n_params=n_params, dtype=dtype, shape=decoder_shape(data))


def decoder_shape(config: dict) -> DecoderShape | None:
    """The decoder's layers, hidden and intermediate sizes from a config.json (Qwen2.5-VL keeps them at the
    top level, Qwen3-VL and newer transformers in text_config)."""
    for section in (config.get("text_config") or {}, config):
        sizes = [section.get(k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size")]
        if all(isinstance(v, int) and v > 0 for v in sizes):
            return DecoderShape(*sizes)
    return None


def _safetensors_numel(path: Path) -> int:
    """Elements of every tensor in one safetensors file (its JSON header only)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise PreflightError(f"{path} is truncated (no safetensors header): download it again")
        (size,) = struct.unpack("<Q", head)
        if size > 100 << 20:
            raise PreflightError(f"{path} is not a safetensors file (header of {size} bytes)")
        try:
            header = json.loads(f.read(size))
        except ValueError:
            raise PreflightError(f"{path} has a corrupt safetensors header: download it again") from None
    total = 0
    for name, entry in header.items():
        if name != "__metadata__":
            n = 1
            for d in entry["shape"]:
                n *= d
            total += n
    return total


def visible_gpus(env: dict[str, str] | None = None) -> list[GpuInfo]:
    """The GPUs this launcher may use, indexed 0.. in CUDA_VISIBLE_DEVICES order ([] when none)."""
    env = os.environ if env is None else env
    smi = shutil.which("nvidia-smi")
    query = [smi, "--query-gpu=index,memory.total,name", "--format=csv,noheader,nounits"]
    if smi is None:  # ask torch in a child (this process must not initialise CUDA)
        query = [sys.executable, "-c", _TORCH_QUERY]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=120, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = parse_nvidia_smi(out)
    return gpus if smi is None else restrict_visible(gpus, env.get("CUDA_VISIBLE_DEVICES"))


_TORCH_QUERY = (
    "import torch\n"
    "for i in range(torch.cuda.device_count()):\n"
    "    p = torch.cuda.get_device_properties(i)\n"
    "    print(f'{i}, {p.total_memory // 2**20}, {p.name}')\n"
)
"""Where nvidia-smi is missing: the same lines from torch (already restricted by CUDA_VISIBLE_DEVICES)."""


def parse_nvidia_smi(text: str) -> list[GpuInfo]:
    """`index, memory.total [MiB], name` lines -> GpuInfo (index = physical until restricted)."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) >= 2 and parts[0].isdigit():
            physical = int(parts[0])
            gpus.append(
                GpuInfo(physical, physical, float(parts[1]) / 1024, parts[2] if len(parts) > 2 else "")
            )
    return gpus


def restrict_visible(gpus: list[GpuInfo], cuda_visible: str | None) -> list[GpuInfo]:
    """Apply CUDA_VISIBLE_DEVICES: the listed physical GPUs, renumbered 0.. in the listed order."""
    if cuda_visible is None:
        return gpus
    by_physical = {g.physical: g for g in gpus}
    out = []
    for item in filter(None, (x.strip() for x in cuda_visible.split(","))):
        if not item.isdigit():
            raise PreflightError(
                f"CUDA_VISIBLE_DEVICES={cuda_visible!r} lists {item!r}: use numeric indices (the launcher "
                "hands each process its GPUs by index)"
            )
        g = by_physical.get(int(item))
        if g is None:
            break  # CUDA stops at the first invalid entry as well
        out.append(GpuInfo(len(out), g.physical, g.memory_gib, g.name))
    return out


def require_vllm() -> None:
    """vLLM must be importable (the generator children inherit this PYTHONPATH)."""
    if importlib.util.find_spec("vllm") is None:
        raise PreflightError(
            "vLLM is not importable, and the generator needs it on a GPU: install the GPU stack with "
            "`pip install -r deploy/docker/requirements-gpu.txt` (vLLM built for its torch), or run the GPU "
            "image deploy/docker/Dockerfile.gpu (docs/install.md)"
        )


def explain_failure(log_text: str) -> str:
    """The fix for the first known failure in a process's log (deploy/failures.py), or ""."""
    failure = classify(log_text)
    return failure.fix if failure is not None else ""
